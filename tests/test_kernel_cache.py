"""numba's cache of the CPU kernels follows every source they are built from."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pyggml.cpu.kernel_cache import kernel_digest, kernel_sources


def test_the_sources_include_the_files_the_products_inline():
    names = {p.name for p in kernel_sources()}
    assert {"qdot.py", "blockdot.py", "simd.py", "qdecode.py", "activations.py", "types.py"} <= names


def test_a_change_to_any_source_or_to_the_code_settings_changes_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PYGGML_NO_VNNI", raising=False)
    copies = []
    for i, p in enumerate(kernel_sources()):  # two of them are __init__.py
        (tmp_path / str(i)).mkdir()
        copies.append(Path(shutil.copy(p, tmp_path / str(i) / p.name)))
    before = kernel_digest(copies)
    assert kernel_digest(copies) == before
    blockdot = next(c for c in copies if c.name == "blockdot.py")
    blockdot.write_text(blockdot.read_text() + "\n# a comment changes nothing, but numba cannot know\n")
    changed = kernel_digest(copies)
    assert changed != before
    monkeypatch.delenv("NUMBA_BOUNDSCHECK", raising=False)
    monkeypatch.setenv("PYGGML_NO_VNNI", "1")
    no_vnni = kernel_digest(copies)
    assert no_vnni not in (before, changed)
    monkeypatch.setenv("NUMBA_BOUNDSCHECK", "1")  # the checked build: a folder of its own
    assert kernel_digest(copies) not in (before, changed, no_vnni)


@pytest.mark.skipif(bool(os.environ.get("NUMBA_CACHE_DIR")), reason="NUMBA_CACHE_DIR set: the user's folder is kept")
def test_the_kernels_are_cached_in_the_folder_of_their_sources():
    from pyggml.cpu import qdot
    from pyggml.hub import cache_dir
    folder = cache_dir() / "numba" / kernel_digest(kernel_sources())
    assert os.path.commonpath([qdot.exact_quant_matmul._cache._cache_path, folder]) == str(folder)


def test_a_cold_cache_is_said_and_compiled_before_the_first_answer(tmp_path, monkeypatch, capsys):
    """A machine that never compiled this version of the kernels: the tools say so in one line and
    compile them while loading, instead of leaving the first answer waiting in silence."""
    from pyggml.cli.common import compile_kernels_once
    from pyggml.cpu import kernel_cache
    monkeypatch.setattr(kernel_cache, "FOLDER", tmp_path)
    assert kernel_cache.is_cold()
    compiled = []
    monkeypatch.setattr("pyggml.cpu.warmup.compile_in_parallel", lambda: compiled.append(True))
    compile_kernels_once()
    assert compiled and "Compiling the CPU kernels for this machine, once" in capsys.readouterr().err
    (tmp_path / "cpu_x").mkdir()
    (tmp_path / "cpu_x" / "nn.silu-74.py311.nbi").write_bytes(b"")  # as numba leaves it
    assert not kernel_cache.is_cold()
    compile_kernels_once()
    assert len(compiled) == 1 and capsys.readouterr().err == ""


def test_old_versions_of_the_cache_are_pruned(tmp_path):
    from pyggml.cpu.kernel_cache import prune
    folders = []
    for i in range(12):
        f = tmp_path / f"{i:016x}"
        (f / "cpu_x").mkdir(parents=True)
        os.utime(f, (1000 + i, 1000 + i))
        folders.append(f)
    (tmp_path / "not-a-version").mkdir()
    prune(folders[0], keep=4)  # the oldest, now used again
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([folders[0].name, *(f.name for f in folders[9:]), "not-a-version"])

"""Where numba keeps the CPU kernels it has compiled: a folder per version of their sources.

numba decides whether a cached function is still fresh from the contents of the function's own
file alone.  Our kernels are built from several files - qdot.py's products inline functions of
qdecode.py and LLVM IR written by simd.py and blockdot.py - so a change to one of those alone
(an upgrade, a ``git pull``) would leave the old machine code in use: wrong results and no
error.  Naming the cache folder after a hash of every source the kernels are built from, and
of the settings that change the code generated (``PYGGML_DOTS``, ``NUMBA_BOUNDSCHECK``), makes each version compile
its own.  ``NUMBA_CACHE_DIR``, when set, is left as the user's choice.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
FOLDER: Path | None = None  # the cache folder in use, once use_versioned_cache chose it
KEEP = 8  # versions kept (the most recently used); each holds tens of MB of machine code


def kernel_sources() -> list[Path]:
    """The files the numba kernels are compiled from (the CPU backend, and the type, block
    layout and batch width constants they read)."""
    return sorted([*(PACKAGE / "cpu").rglob("*.py"), PACKAGE / "types.py", PACKAGE / "batch_rules.py",
                   *(PACKAGE / "quants").glob("*.py")])


def kernel_digest(sources: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sources:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for setting in ("PYGGML_DOTS", "NUMBA_BOUNDSCHECK"):  # each compiles other machine code
        h.update(f"{setting}={os.environ.get(setting, '')}".encode())
    return h.hexdigest()[:16]


def use_versioned_cache() -> None:
    """Point numba's cache at ``<pyggml cache>/numba/<digest>`` (before any kernel is defined).
    Where that folder cannot be written, numba's own choice stays."""
    import numba

    from ..cache import cache_dir
    if numba.config.CACHE_DIR:
        return
    folder = cache_dir() / "numba" / kernel_digest(kernel_sources())
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if os.access(folder, os.W_OK):
        global FOLDER
        numba.config.CACHE_DIR = str(folder)
        FOLDER = folder
        prune(folder)


def prune(current: Path, keep: int = KEEP) -> None:
    """Mark ``current`` used now and remove all but the ``keep`` versions used last: every edit or
    upgrade of the kernel sources makes a new one, and nothing else ever removes the old."""
    import shutil
    try:
        os.utime(current)
        versions = sorted((p for p in current.parent.iterdir() if p.is_dir() and len(p.name) == 16),
                          key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    for old in versions[keep:]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)

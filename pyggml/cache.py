"""Where pyggml keeps what it fetches or computes once: models, compiled kernels, file digests,
the RPC servers' tensor caches.  ``PYGGML_CACHE`` moves it (tests point it at a folder of their own)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("PYGGML_CACHE", Path.home() / ".cache" / "pyggml"))

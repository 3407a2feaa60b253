"""The server's tensor cache (``--cache-dir``): weights kept on disk by the hash of their bytes.

A client that loads the same model again sends only hashes (``SET_TENSOR_HASH``); the
server answers from its cache.  Files are named by the SHA-256 of their content, written
to a temporary name and renamed into place (a crash never leaves a half-written entry),
and hashed again when read: a corrupted file is deleted and counts as a miss.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("pyggml.rpc.cache")


def digest(data) -> bytes:
    """The 32-byte SHA-256 of a bytes-like object (hashlib releases the GIL on large inputs)."""
    return hashlib.sha256(memoryview(data).cast("B")).digest()


class TensorCache:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = self.stores = 0

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.bin"

    def get(self, key: bytes, size: int) -> bytes | None:
        """The cached bytes with this hash and size, verified, or None."""
        path = self._path(key)
        try:
            if path.stat().st_size != size:
                self.misses += 1
                return None
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        if digest(data) != key:
            log.warning("tensor cache: %s is corrupt, removing it", path.name)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        return data

    def put(self, data, key: bytes | None = None) -> bytes:
        """Store bytes under their hash (atomically); returns the hash."""
        key = key or digest(data)
        path = self._path(key)
        if path.exists():
            return key
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".incoming-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(data).cast("B"))
            os.replace(tmp, path)
            self.stores += 1
        except OSError as e:
            log.warning("tensor cache: cannot store %s: %s", path.name, e)
            Path(tmp).unlink(missing_ok=True)
        return key

"""The server's tensor cache (``--cache-dir``): weights kept on disk by the hash of their bytes.

A client that loads the same model again sends only hashes (``SET_TENSOR_HASH``); the
server answers from its cache.  Files are named by the SHA-256 of their content, written
to a temporary name and renamed into place (a crash never leaves a half-written entry),
and hashed again when read: a corrupted file is deleted and counts as a miss.

The cache holds at most ``max_bytes`` (``--cache-max``): storing past that evicts the entries
used least recently (a hit counts as a use, and marks the file's modification time, so the
order survives a restart).  An entry larger than the whole cache is not stored.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("pyggml.rpc.cache")

_NAME_CHARS = set("0123456789abcdef")


def digest(data) -> bytes:
    """The 32-byte SHA-256 of a bytes-like object (hashlib releases the GIL on large inputs)."""
    return hashlib.sha256(memoryview(data).cast("B")).digest()


class TensorCache:
    def __init__(self, directory: str | os.PathLike, max_bytes: int = 20 << 30) -> None:
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.hits = self.misses = self.stores = self.evictions = 0
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # key -> size, least recently used first
        self._load_index()

    @property
    def size(self) -> int:
        return sum(self._entries.values())

    def _load_index(self) -> None:
        """The entries on disk, oldest use first; leftovers of interrupted writes removed."""
        found = []
        for path in self.dir.iterdir():
            if path.name.startswith(".incoming-"):
                path.unlink(missing_ok=True)
                continue
            stem = path.name.removesuffix(".bin")
            if path.suffix != ".bin" or len(stem) != 64 or not set(stem) <= _NAME_CHARS:
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime, bytes.fromhex(stem), st.st_size))
        for _, key, size in sorted(found):
            self._entries[key] = size
        self._evict(0)

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.bin"

    def _touch(self, key: bytes) -> None:
        self._entries.move_to_end(key)
        try:
            os.utime(self._path(key), (time.time(), time.time()))
        except OSError:
            pass

    def _drop(self, key: bytes) -> None:
        self._entries.pop(key, None)
        self._path(key).unlink(missing_ok=True)

    def _evict(self, room: int) -> None:
        """Remove least recently used entries until ``room`` more bytes fit."""
        total = self.size
        while self._entries and total + room > self.max_bytes:
            key, size = next(iter(self._entries.items()))
            self._drop(key)
            total -= size
            self.evictions += 1

    def get(self, key: bytes, size: int) -> bytes | None:
        """The cached bytes with this hash and size, verified, or None."""
        path = self._path(key)
        if key not in self._entries:  # another server sharing the folder may have stored it
            try:
                if path.stat().st_size == size and size <= self.max_bytes:
                    self._evict(size)
                    self._entries[key] = size
            except OSError:
                pass
        if self._entries.get(key) != size:
            self.misses += 1
            return None
        try:
            data = path.read_bytes()
        except OSError:
            self._entries.pop(key, None)
            self.misses += 1
            return None
        if digest(data) != key:
            log.warning("tensor cache: %s is corrupt, removing it", path.name)
            self._drop(key)
            self.misses += 1
            return None
        self._touch(key)
        self.hits += 1
        return data

    def put(self, data, key: bytes | None = None) -> tuple[bytes, bool]:
        """Store bytes under their hash (atomically): (the hash, whether new bytes were written)."""
        key = key or digest(data)
        view = memoryview(data).cast("B")
        if key in self._entries:
            self._touch(key)
            return key, False
        if len(view) > self.max_bytes:
            return key, False
        self._evict(len(view))
        path = self._path(key)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".incoming-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(view)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("tensor cache: cannot store %s: %s", path.name, e)
            Path(tmp).unlink(missing_ok=True)
            return key, False
        self._entries[key] = len(view)
        # its time of use from the clock _touch uses: the file system stamps a new file from a
        # coarser clock, which may lag an earlier _touch's time and invert the order on a restart
        self._touch(key)
        self.stores += 1
        return key, True

"""A file's identity: the SHA-256 of its whole content, computed once and remembered.

An RPC client and server that hold the same GGUF recognise it by this digest, whatever
the file is called (``pyggml-rpc-server --gguf``).  Hashing a large model takes a while, so
digests are kept in ``~/.cache/pyggml/file-ids.json`` keyed by resolved path, size,
modification and change times and inode: a restart, or a second load of an unchanged file,
hashes nothing, and a file rewritten in place (whatever its size and mtime) is hashed again.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

from pyggml.cache import cache_dir

_lock = threading.Lock()
hashed_files = 0  # files hashed by this process (a warm start hashes none)
_known: dict[str, bytes] = {}  # this process's digests by _key (loading asks once per tensor)


def _index_path() -> Path:
    return cache_dir() / "file-ids.json"


def _key(path: Path) -> str:
    st = path.stat()  # a rewrite that keeps size and mtime still changes ctime; a replacement, the inode
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_dev}:{st.st_ino}"


def _load() -> dict[str, str]:
    try:
        data = json.loads(_index_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def file_identity(path: str | os.PathLike) -> bytes:
    """The 32-byte SHA-256 of the file at ``path`` (from the index when it is unchanged)."""
    global hashed_files
    p = Path(path)
    key = _key(p)
    with _lock:
        if key in _known:
            return _known[key]
        known = _load().get(key)
        if isinstance(known, str) and len(known) == 64:
            try:
                _known[key] = bytes.fromhex(known)
                return _known[key]
            except ValueError:
                pass
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        digest = _known[key] = h.digest()
        hashed_files += 1
        here = key.split("|", 1)[0]  # (this path's older entries are of bytes it no longer holds)
        index = {k: v for k, v in _load().items()
                 if k.split("|", 1)[0] != here and Path(k.split("|", 1)[0]).exists()}
        index[key] = digest.hex()
        target = _index_path()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".file-ids-", dir=target.parent)
            with os.fdopen(fd, "w") as out:
                json.dump(index, out)
            os.replace(tmp, target)  # whole or not at all, whoever else writes it
        except OSError:
            pass  # a read-only cache only costs hashing again next time
        return digest

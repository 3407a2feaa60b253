"""The GGUF files a server holds (``pyggml-rpc-server --gguf PATH``), from which clients
that load the same file ask it to fill tensors instead of sending their bytes.

Each file is known by its identity (the SHA-256 of the whole file, remembered across
restarts: pyggml/file_identity.py) and parsed once, so that every request - file,
offset, size - is checked against the file's real tensor table before any byte moves:
the range must lie inside one tensor's data.  Nothing the client says is trusted beyond
choosing among the ranges the file itself declares.
"""
from __future__ import annotations

import bisect
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pyggml.file_identity import file_identity
from pyggml.gguf import GGUFError, GGUFFile

from .protocol import ProtocolError

log = logging.getLogger("pyggml.rpc.files")

ENTRY = struct.Struct("<32sH")  # identity, length of the name that follows
MAX_FILES = 256
MAX_NAME = 255


@dataclass
class HeldFile:
    path: Path
    identity: bytes
    gguf: GGUFFile
    starts: list[int]   # each tensor's data range in the file, sorted by start
    ends: list[int]

    def data(self, offset: int, size: int) -> memoryview:
        """The bytes [offset, offset + size) of the file, which must lie in one tensor's data."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if size <= 0 or i < 0 or offset + size > self.ends[i]:
            raise ProtocolError(f"bytes [{offset}, {offset + size}) of {self.path.name} are not inside one "
                                f"tensor's data")
        return memoryview(self.gguf.map)[offset:offset + size]


class ServerFiles:
    def __init__(self, paths: list[str | os.PathLike]) -> None:
        self.files: dict[bytes, HeldFile] = {}
        for path in paths:
            p = Path(path).expanduser()
            found = sorted(p.glob("*.gguf")) if p.is_dir() else [p]
            if not found:
                raise ValueError(f"--gguf {path}: no .gguf files there")
            for f in found:
                self._add(f)
        if len(self.files) > MAX_FILES:
            raise ValueError(f"--gguf: {len(self.files)} files, more than {MAX_FILES}")

    def _add(self, path: Path) -> None:
        try:
            gguf = GGUFFile(path)
        except GGUFError as e:
            raise ValueError(f"--gguf: {e}") from None
        ranges = sorted((t.offset, t.offset + t.nbytes) for t in gguf.tensors.values() if t.nbytes)
        identity = file_identity(path)
        self.files[identity] = HeldFile(path, identity, gguf, [a for a, _ in ranges], [b for _, b in ranges])
        log.info("holding %s (%s...)", path.name, identity.hex()[:16])

    def get(self, identity: bytes) -> HeldFile:
        f = self.files.get(bytes(identity))
        if f is None:
            raise ProtocolError("this server holds no file with that identity")
        return f

    def listing(self) -> bytes:
        """What HELLO tells clients: each file's identity and name."""
        out = bytearray()
        for f in self.files.values():
            name = f.path.name.encode()[:MAX_NAME]
            out += ENTRY.pack(f.identity, len(name)) + name
        return bytes(out)


def parse_listing(data: bytes | memoryview) -> dict[bytes, str]:
    """The client's reading of a HELLO listing: identity -> file name."""
    data = memoryview(data).cast("B")
    out: dict[bytes, str] = {}
    at = 0
    while at < len(data) and len(out) < MAX_FILES:
        if at + ENTRY.size > len(data):
            raise ValueError("truncated file listing")
        identity, n = ENTRY.unpack_from(data, at)
        at += ENTRY.size
        if n > MAX_NAME or at + n > len(data):
            raise ValueError("malformed file listing")
        out[bytes(identity)] = bytes(data[at:at + n]).decode("utf-8", "replace")
        at += n
    return out

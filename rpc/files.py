"""The GGUF files a server holds (``pyggml-rpc-server --gguf PATH``), from which clients
that load the same file ask it to fill tensors instead of sending their bytes.

Each file is known by its identity (the SHA-256 of the whole file, remembered across
restarts by path, size, times and inode: rpc/file_identity.py) and parsed once, so that
every request - file, offset, size - is checked against the file's real tensor table before
any byte moves: the range must lie inside one tensor's data.  Nothing the client says is
trusted beyond choosing among the ranges the file itself declares.

A held file may change under the server: rewritten in place, replaced, truncated.  Its bytes
are read with ``pread`` from the descriptor opened when it was hashed - never through a memory
map, which a truncated file answers with SIGBUS - and the file is checked unchanged (inode,
size, modification and change times, of the descriptor and of the path) before and after each
read.  A file that changed is refused by name from then on (the client uploads instead), and
hashed again in a thread of its own: once that is done, it is offered under its new identity.
"""
from __future__ import annotations

import bisect
import logging
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pyggml.rpc.file_identity import file_identity
from pyggml.gguf import GGUFError, GGUFFile

from .protocol import ProtocolError

log = logging.getLogger("pyggml.rpc.files")

ENTRY = struct.Struct("<32sH")  # identity, length of the name that follows
MAX_FILES = 256
MAX_NAME = 255


def signature(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file's bytes may have: a rewrite changes the times, a replacement the inode."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass
class HeldFile:
    path: Path
    identity: bytes
    fd: int
    signature: tuple[int, ...]
    starts: list[int]   # each tensor's data range in the file, sorted by start
    ends: list[int]
    changed: bool = False

    @classmethod
    def open(cls, path: Path) -> HeldFile:
        """Parse and hash ``path``, holding a descriptor of the very bytes that were hashed."""
        for _ in range(3):
            fd = os.open(path, os.O_RDONLY)
            try:
                before = signature(os.fstat(fd))
                try:
                    gguf = GGUFFile(path)
                    ranges = sorted((t.offset, t.offset + t.nbytes) for t in gguf.tensors.values() if t.nbytes)
                    gguf.close()
                except GGUFError as e:
                    raise ValueError(f"--gguf: {e}") from None
                identity = file_identity(path)
                if signature(os.fstat(fd)) == before == signature(os.stat(path)):
                    return cls(path, identity, fd, before, [a for a, _ in ranges], [b for _, b in ranges])
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # it changed while we read it: again
        raise ValueError(f"--gguf {path}: the file keeps changing")

    def unchanged(self) -> bool:
        try:
            return signature(os.fstat(self.fd)) == self.signature == signature(os.stat(self.path))
        except OSError:
            return False

    def data(self, offset: int, size: int) -> bytearray:
        """The bytes [offset, offset + size) of the file, which must lie in one tensor's data;
        ProtocolError if the file changed since it was hashed (or while they were read)."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if size <= 0 or i < 0 or offset + size > self.ends[i]:
            raise ProtocolError(f"bytes [{offset}, {offset + size}) of {self.path.name} are not inside one "
                                f"tensor's data")
        out = bytearray(size)
        got = 0
        if not self.changed and self.unchanged():
            with memoryview(out) as view:
                while got < size:
                    n = os.preadv(self.fd, [view[got:]], offset + got)
                    if n <= 0:
                        break
                    got += n
        if got != size or not self.unchanged():
            self.changed = True
            raise ProtocolError(f"{self.path.name} changed on this server's disk since it was hashed; send the "
                                f"bytes instead (the server hashes it again)")
        return out

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class ServerFiles:
    files: dict[bytes, HeldFile] = field(default_factory=dict)
    _rehashing: set[Path] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_paths(cls, paths: list[str | os.PathLike]) -> ServerFiles:
        held = cls()
        for path in paths:
            p = Path(path).expanduser()
            found = sorted(p.glob("*.gguf")) if p.is_dir() else [p]
            if not found:
                raise ValueError(f"--gguf {path}: no .gguf files there")
            for f in found:
                held._add(HeldFile.open(f))
        if len(held.files) > MAX_FILES:
            raise ValueError(f"--gguf: {len(held.files)} files, more than {MAX_FILES}")
        return held

    def _add(self, f: HeldFile) -> None:
        with self._lock:
            self.files[f.identity] = f
        log.info("holding %s (%s...)", f.path.name, f.identity.hex()[:16])

    def get(self, identity: bytes) -> HeldFile:
        f = self.files.get(bytes(identity))
        if f is None:
            raise ProtocolError("this server holds no file with that identity")
        if f.changed:
            self._rehash(f)
        return f

    def data(self, identity: bytes, offset: int, size: int) -> bytearray:
        f = self.get(identity)
        try:
            return f.data(offset, size)
        except ProtocolError:
            if f.changed:
                self._rehash(f)
            raise

    def _rehash(self, old: HeldFile) -> None:
        """Offer a changed file under its new identity once it is hashed again (in a thread:
        hashing a large file must not keep the server's loop)."""
        with self._lock:
            if self.files.get(old.identity) is old:
                del self.files[old.identity]
            if old.path in self._rehashing:
                return
            self._rehashing.add(old.path)
        log.warning("%s changed on disk since it was hashed: hashing it again", old.path)

        def work() -> None:
            try:
                self._add(HeldFile.open(old.path))
            except (OSError, ValueError) as e:
                log.warning("%s is no longer offered: %s", old.path, e)
            finally:
                with self._lock:
                    self._rehashing.discard(old.path)
                old.close()
        threading.Thread(target=work, name="pyggml-rpc-rehash", daemon=True).start()

    def listing(self) -> bytes:
        """What HELLO tells clients: each file's identity and name."""
        out = bytearray()
        with self._lock:
            held = list(self.files.values())
        for f in held:
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

"""A fast reader for GGUF's header: metadata and tensor descriptions from the memory map.

``gguf.GGUFReader`` builds a numpy view per field part: on Gemma 3's 262k-token vocabulary
that is 8 s and ~750 MB before a single weight is read.  This reader walks the same
format (the value type numbers come from the ``gguf`` package) once, in well under a second.
Arrays stay compact while the model is loaded: numbers as numpy arrays, strings (a vocabulary
of 262k pieces) as one block of bytes decoded piece by piece on access (``StringArray``) -
as Python lists they held ~25 MB for Gemma 3 for as long as the file was open.  Every read is
bounds-checked: a truncated or corrupt header is a ``ValueError`` saying where, never a crash.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType as V

_SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
            V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
_NUMPY = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
          V.FLOAT32: "<f4", V.BOOL: "?", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8"}
MAX_DIMS = 4


@dataclass
class RawTensor:
    name: str
    type: int
    shape: tuple[int, ...]   # ne, innermost first
    offset: int              # absolute offset of its data in the file


class StringArray(Sequence):
    """A GGUF array of strings, kept as its UTF-8 bytes and offsets; items decode on access."""

    def __init__(self, blob: bytes, offsets: np.ndarray) -> None:
        self._blob, self._offsets = blob, offsets  # offsets: n + 1 positions in blob

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("StringArray index out of range")
        return self._blob[self._offsets[i]:self._offsets[i + 1]].decode("utf-8", errors="replace")

    def __iter__(self):
        blob, offs = self._blob, self._offsets.tolist()
        for a, b in zip(offs, offs[1:]):
            yield blob[a:b].decode("utf-8", errors="replace")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"truncated or corrupt file: {n} bytes needed at offset {self.pos}, "
                             f"the file has {len(self.buf)}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def strings(self, count: int) -> StringArray:
        """``count`` length-prefixed strings, kept as one block of bytes (the lengths dropped).
        The walk from length to length is the only Python per string (a vocabulary holds
        hundreds of thousands); the bytes are gathered at once."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        if count > (size - pos) // 8:  # each takes 8 bytes at least: no list of a size the file cannot hold
            raise ValueError(f"truncated or corrupt file: {count} strings at offset {pos}, the file has {size} bytes")
        unpack_from = struct.unpack_from
        starts, lengths = [0] * count, [0] * count
        for i in range(count):
            n = unpack_from("<Q", buf, pos)[0] if pos + 8 <= size else -1
            if not 0 <= n <= size - pos - 8:
                raise ValueError(f"truncated or corrupt file: string {i} of {count} at offset {pos} "
                                 f"runs past the end ({size} bytes)")
            starts[i], lengths[i] = pos + 8, n
            pos += 8 + n
        self.pos = pos
        lengths_np = np.array(lengths, dtype=np.int64)
        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths_np, out=offsets[1:])
        # byte j of string i sits at starts[i] + (j - offsets[i])
        at = np.repeat(np.array(starts, dtype=np.int64) - offsets[:-1], lengths_np) + np.arange(offsets[-1])
        return StringArray(np.frombuffer(buf, dtype=np.uint8)[at].tobytes(), offsets)

    def value(self, vtype: int) -> Any:
        if vtype == V.STRING:
            return self.string()
        if vtype == V.ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype == V.STRING:
                return self.strings(count)
            if etype == V.ARRAY:
                return [self.value(V.ARRAY) for _ in range(count)]
            if etype not in _NUMPY:
                raise ValueError(f"truncated or corrupt file: unknown array element type {etype}")
            dtype = np.dtype(_NUMPY[etype])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
        if vtype not in _SCALARS:
            raise ValueError(f"truncated or corrupt file: unknown value type {vtype} at offset {self.pos}")
        return self.unpack(_SCALARS[vtype])


def parse(buf: memoryview) -> tuple[int, dict[str, Any], list[RawTensor]]:
    """(version, metadata, tensors) of a GGUF file's bytes."""
    c = _Cursor(buf)
    if bytes(c.take(4)) != b"GGUF":
        raise ValueError("not a GGUF file")
    version = c.unpack("<I")
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    if n_tensors > len(buf) // 24 or n_kv > len(buf) // 12:  # each needs at least that many bytes
        raise ValueError(f"truncated or corrupt file: {n_tensors} tensors and {n_kv} metadata entries claimed")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"truncated or corrupt file: tensor {name!r} has {n_dims} dimensions")
        shape = tuple(c.unpack("<Q") for _ in range(n_dims))
        infos.append((name, shape, c.unpack("<I"), c.unpack("<Q")))
    alignment = int(meta.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"truncated or corrupt file: general.alignment {alignment} is not a power of two")
    data_start = (c.pos + alignment - 1) // alignment * alignment
    return version, meta, [RawTensor(name, ttype, shape, data_start + off) for name, shape, ttype, off in infos]

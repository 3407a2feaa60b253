"""GGUF files: metadata, tensor descriptions, and weights placed into device buffers.

The file is memory-mapped and its header read by :mod:`pyggml.gguf_parse` (with the
``gguf`` package's type numbers; its own reader takes seconds and hundreds of MB on large
vocabularies); each tensor's bytes go straight from the map into the buffer of the device
it is assigned to, quantized as stored.  Every
problem with the file (missing, not GGUF, truncated, unknown tensor type, data past the
end) is a :class:`GGUFError` that names the file and the problem.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .backend import Buffer, BufferType, BufferUsage, alloc_tensors
from .tensor import Tensor
from .types import Type

log = logging.getLogger("pyggml.gguf")

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass
class TensorInfo:
    name: str
    type: Type
    ne: tuple[int, ...]
    offset: int      # absolute byte offset in the file
    nbytes: int
    data: np.ndarray  # uint8 view into the memory map


@dataclass
class FileSlice:
    """``nbytes`` of a tensor's data from ``start`` on, in a model file being loaded: what
    :meth:`Buffer.load_tensor` fills a weight from (pyggml.backend.TensorSource).  With
    ``count`` > 1 the bytes are that many pieces of equal size, ``stride`` apart in the file
    (the same rows of every expert of a stack, for a tensor split), one after another in the
    tensor."""

    gguf: GGUFFile
    info: TensorInfo
    start: int
    nbytes: int
    file: BinaryIO | None  # the file open for reading, or None to take the bytes from its map
    count: int = 1
    stride: int = 0

    @property
    def path(self) -> Path:
        return self.gguf.path

    @property
    def file_offset(self) -> int:
        return self.info.offset + self.start

    def pieces(self) -> list[tuple[int, int, int]]:
        """(offset into the tensor, offset into the file, bytes) of each piece."""
        size = self.nbytes // self.count
        return [(i * size, self.file_offset + i * self.stride, size) for i in range(self.count)]

    def read(self) -> np.ndarray:
        if self.file is None and self.count == 1:
            return self.info.data[self.start:self.start + self.nbytes]
        return self.read_into(np.empty(self.nbytes, dtype=np.uint8))

    def read_into(self, out: np.ndarray) -> np.ndarray:
        for at, offset, size in self.pieces():
            start = offset - self.info.offset
            if self.file is None:
                out[at:at + size] = self.info.data[start:start + size]
            else:
                self.gguf._read_into(self.file, self.info, out[at:at + size], start)
        return out


class GGUFFile:
    """An opened GGUF file: ``metadata`` (dict) and ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._check_header()
        from .gguf_parse import parse
        try:
            self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
            _, self.metadata, self._raw_tensors = parse(memoryview(self.map))
        except (ValueError, OSError) as e:
            raise GGUFError(self.path, str(e)) from None
        self.tensors = self._read_tensors()

    # -- validation -------------------------------------------------------------------------------
    def _check_header(self) -> None:
        if not self.path.exists():
            raise GGUFError(self.path, "no such file")
        if not self.path.is_file():
            raise GGUFError(self.path, "not a regular file")
        self.file_size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
        if len(head) < 8:
            raise GGUFError(self.path, f"truncated: {len(head)} bytes is too short for a GGUF header")
        if head[:4] != GGUF_MAGIC:
            raise GGUFError(self.path, f"not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
        version = int.from_bytes(head[4:8], "little")
        if version not in (2, 3):
            raise GGUFError(self.path, f"unsupported GGUF version {version} (supported: 2, 3)")

    def _read_tensors(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for t in self._raw_tensors:
            try:
                ttype = Type(t.type)
            except ValueError:
                raise GGUFError(self.path, f"tensor {t.name!r} has unsupported type {t.type}") from None
            ne = t.shape
            if ne[0] % ttype.block_size:
                raise GGUFError(self.path, f"tensor {t.name!r}: ne[0]={ne[0]} is not a multiple of the "
                                           f"{ttype.name} block size")
            nbytes = ttype.row_size(ne[0]) * int(np.prod(ne[1:], dtype=np.int64))
            if t.offset + nbytes > self.file_size:
                raise GGUFError(self.path, f"tensor {t.name!r} data ends at byte {t.offset + nbytes}, "
                                           f"past the end of the file ({self.file_size} bytes)")
            out[t.name] = TensorInfo(t.name, ttype, ne, t.offset, nbytes, self.map[t.offset:t.offset + nbytes])
        return out

    # -- access -------------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def new_tensor(self, name: str) -> Tensor:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(self.path, f"missing tensor {name!r}")
        return Tensor(info.type, info.ne, name=name)

    def load(self, tensors: Iterable[Tensor], buft_of: Callable[[Tensor], BufferType] | BufferType,
             progress: bool | None = None, source_of: Callable[[Tensor], str] | None = None,
             mmap: bool = True) -> list[Buffer]:
        """Allocate ``tensors`` (made by :meth:`new_tensor`) per buffer type and fill them from the file.

        ``source_of`` names the file tensor each one is read from (default: its own name), so
        that one file tensor can fill several (a tied output head on another device); or gives
        ``(name, start, nbytes[, count, stride])``, that many bytes from ``start`` into its data
        (the rows a device holds of a tensor split), in ``count`` pieces ``stride`` apart.  With
        ``mmap``, tensors in host memory stay in the file's map (nothing copied); without,
        every buffer holds its tensors one after another in the order given, read from the
        file (not through the map, whose pages would count in this process's memory too).
        """
        from tqdm import tqdm

        tensors = list(tensors)
        pick = buft_of if callable(buft_of) else (lambda t: buft_of)
        named = source_of or (lambda t: t.name)

        def span(t: Tensor) -> tuple[TensorInfo, int, int, int, int]:
            src = named(t)
            if isinstance(src, str):
                info = self.tensors[src]
                return info, 0, info.nbytes, 1, 0
            name, start, nbytes, count, stride = (*src, 1, 0)[:5]
            info = self.tensors[name]
            end = start + (count - 1) * stride + nbytes // count if count >= 1 else -1
            if start < 0 or count < 1 or nbytes % count or end > info.nbytes:
                raise GGUFError(self.path, f"bytes {start}..{end} of tensor {name!r} are outside its data")
            return info, start, nbytes, count, stride

        groups: dict[int, tuple[BufferType, list[Tensor]]] = {}
        mapped: dict[int, tuple[BufferType, list[Tensor]]] = {}
        for t in tensors:
            buft = pick(t)
            # with mmap, a tensor stored as it will be used may stay in the file's map
            info, _, nbytes, count, _ = span(t)
            same = info.type == t.type and nbytes == t.nbytes() and count == 1 and t.is_contiguous()
            into = mapped if mmap and same else groups
            into.setdefault(id(buft), (buft, []))[1].append(t)
        buffers = []
        for buft, ts in mapped.values():
            buffer = self._map_into(ts, buft, span)
            if buffer is not None:
                buffers.append(buffer)
            else:  # not host memory: loaded as the others are
                groups.setdefault(id(buft), (buft, []))[1].extend(ts)
        buffers += [alloc_tensors(ts, buft, BufferUsage.WEIGHTS) for buft, ts in groups.values()]
        tensors = [t for _, ts in groups.values() for t in ts]
        total = sum(span(t)[2] for t in tensors)
        show = progress if progress is not None else total > 32 << 20 and sys.stderr.isatty()
        summaries: dict[str, Buffer] = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {self.path.name}",
                  disable=not show, leave=False) as bar, open(self.path, "rb") as file:
            for t in tensors:
                info, start, nbytes, count, stride = span(t)
                if t.buffer.load_summary() is not None:
                    summaries.setdefault(t.buffer.get_type().get_name(), t.buffer)
                t.buffer.load_tensor(t, FileSlice(self, info, start, nbytes, None if mmap else file, count, stride))
                bar.update(nbytes)
                if summaries:
                    bar.set_postfix_str("; ".join(f"{n}: {b.load_summary()}" for n, b in summaries.items()),
                                        refresh=False)
        for name, buffer in summaries.items():
            log.info("%s: weights %s", name, buffer.load_summary())
        return buffers

    def _read_into(self, file, info: TensorInfo, out: np.ndarray, start: int = 0) -> np.ndarray:
        """``out.nbytes`` of a tensor's bytes from ``start`` on, read from the open file into ``out``."""
        file.seek(info.offset + start)
        if file.readinto(memoryview(out)) != out.nbytes:
            raise GGUFError(self.path, f"tensor {info.name!r}: the file ended while reading it")
        return out

    def _map_into(self, tensors: list[Tensor], buft: BufferType,
                  span: Callable[[Tensor], tuple[TensorInfo, int, int]]) -> Buffer | None:
        """ggml's mmap loading: one host buffer over the whole file, each tensor at its own
        offset, so the page cache holds the weights once and loading copies nothing.  None
        where ``buft`` cannot map memory (not host memory)."""
        buffer = buft.buffer_from_map(self.map)
        if buffer is None:
            return None
        buffer.set_usage(BufferUsage.WEIGHTS)
        for t in tensors:
            info, start, *_ = span(t)
            t.buffer, t.offset = buffer, info.offset + start
        return buffer

    def close(self) -> None:
        self.map = None  # the memory map goes once the tensors' views are gone too


def load(path: str | os.PathLike, buft: BufferType | None = None) -> tuple[GGUFFile, dict[str, Tensor]]:
    """Open a GGUF and load every tensor into ``buft`` (the CPU by default)."""
    f = GGUFFile(path)
    if buft is None:
        from . import cpu_device
        buft = cpu_device().get_buffer_type()
    tensors = {name: f.new_tensor(name) for name in f.tensors}
    f.load(tensors.values(), buft)
    return f, tensors

"""GGUF files: metadata, tensor descriptions, and weights placed into device buffers.

Reading uses the ``gguf`` package's memory-mapped reader; each tensor's bytes go straight
from the map into the buffer of the device it is assigned to, quantized as stored.  Every
problem with the file (missing, not GGUF, truncated, unknown tensor type, data past the
end) is a :class:`GGUFError` that names the file and the problem.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .backend import Buffer, BufferType, BufferUsage, alloc_tensors
from .tensor import Tensor
from .types import Type

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


class GGUFFile:
    """An opened GGUF file: ``metadata`` (dict) and ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._check_header()
        import gguf  # the reader is the gguf package's; errors are translated below
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader fails deep inside numpy on corrupt files
            raise GGUFError(self.path, self._diagnose(e)) from None
        self.metadata = self._read_metadata()
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

    def _diagnose(self, err: Exception) -> str:
        text = str(err)
        if "GGMLQuantizationType" in text or "is not a valid" in text:
            return f"unknown tensor type ({text})"
        if isinstance(err, (IndexError, EOFError)) or "buffer" in text or "size" in text or "offset" in text:
            return f"truncated or corrupt file ({type(err).__name__}: {text})"
        return f"cannot parse GGUF ({type(err).__name__}: {text})"

    def _read_metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                meta[key] = field.contents()
            except Exception as e:
                raise GGUFError(self.path, f"unreadable metadata value {key!r} ({e})") from None
        return meta

    def _read_tensors(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for t in self.reader.tensors:
            try:
                ttype = Type(int(t.tensor_type))
            except ValueError:
                raise GGUFError(self.path, f"tensor {t.name!r} has unsupported type "
                                           f"{getattr(t.tensor_type, 'name', t.tensor_type)}") from None
            ne = tuple(int(n) for n in t.shape)
            if ne[0] % ttype.block_size:
                raise GGUFError(self.path, f"tensor {t.name!r}: ne[0]={ne[0]} is not a multiple of the "
                                           f"{ttype.name} block size")
            nbytes = ttype.row_size(ne[0]) * int(np.prod(ne[1:], dtype=np.int64))
            if t.data_offset + nbytes > self.file_size:
                raise GGUFError(self.path, f"tensor {t.name!r} data ends at byte {t.data_offset + nbytes}, "
                                           f"past the end of the file ({self.file_size} bytes)")
            data = np.asarray(t.data).reshape(-1).view(np.uint8)
            if data.size != nbytes:
                raise GGUFError(self.path, f"tensor {t.name!r}: {data.size} bytes of data, expected {nbytes}")
            out[t.name] = TensorInfo(t.name, ttype, ne, int(t.data_offset), nbytes, data)
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
             progress: bool | None = None, source_of: Callable[[Tensor], str] | None = None) -> list[Buffer]:
        """Allocate ``tensors`` (made by :meth:`new_tensor`) per buffer type and fill them from the file.

        ``source_of`` names the file tensor each one is read from (default: its own name), so
        that one file tensor can fill several (a tied output head on another device).
        """
        from tqdm import tqdm

        tensors = list(tensors)
        pick = buft_of if callable(buft_of) else (lambda t: buft_of)
        groups: dict[int, tuple[BufferType, list[Tensor]]] = {}
        for t in tensors:
            buft = pick(t)
            groups.setdefault(id(buft), (buft, []))[1].append(t)
        buffers = [alloc_tensors(ts, buft, BufferUsage.WEIGHTS) for buft, ts in groups.values()]
        source = source_of or (lambda t: t.name)
        total = sum(self.tensors[source(t)].nbytes for t in tensors)
        show = progress if progress is not None else total > 32 << 20 and sys.stderr.isatty()
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {self.path.name}",
                  disable=not show, leave=False) as bar:
            for t in tensors:
                info = self.tensors[source(t)]
                t.buffer.set_tensor(t, info.data)
                bar.update(info.nbytes)
        return buffers

    def close(self) -> None:
        self.reader = None  # drops the memory map once the tensors' views are gone


def load(path: str | os.PathLike, buft: BufferType | None = None) -> tuple[GGUFFile, dict[str, Tensor]]:
    """Open a GGUF and load every tensor into ``buft`` (the CPU by default)."""
    f = GGUFFile(path)
    if buft is None:
        from . import cpu_device
        buft = cpu_device().get_buffer_type()
    tensors = {name: f.new_tensor(name) for name in f.tensors}
    f.load(tensors.values(), buft)
    return f, tensors

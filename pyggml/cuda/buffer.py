"""CUDA buffers: single device allocations, and the strided views the kernels see them through.

A buffer is one ``cupy.cuda.alloc`` allocation; a tensor is a byte offset in it, and the op
kernels see it through a strided ``cupy.ndarray`` over those bytes (``tensor_view``), just
as the CPU backend sees numpy views.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..backend import Buffer, BufferType, Device
from ..tensor import Tensor

if TYPE_CHECKING:
    from .device import CUDADevice


def cupy_module():
    """CuPy, imported on first use: the package loads (and the CPU runs) without it."""
    import cupy
    return cupy


class CUDABufferType(BufferType):
    def __init__(self, device: CUDADevice) -> None:
        self.device = device

    def get_name(self) -> str:
        return self.device.get_name()

    def alloc_buffer(self, size: int) -> CUDABuffer:
        cp = cupy_module()
        with cp.cuda.Device(self.device.index):
            try:
                mem = cp.cuda.alloc(max(size, 1))
            except cp.cuda.memory.OutOfMemoryError:
                free, total = self.device.get_memory()
                raise MemoryError(f"{self.device.get_name()}: out of memory allocating {size / 2**20:.1f} MiB "
                                  f"({free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB)") from None
        return CUDABuffer(self, mem, size)

    def get_alignment(self) -> int:
        return 256

    def get_device(self) -> Device:
        return self.device


class CUDABuffer(Buffer):
    def __init__(self, buft: CUDABufferType, mem, size: int) -> None:
        super().__init__(buft, size)
        self.mem = mem

    def _bytes(self, tensor: Tensor, offset: int, size: int | None):
        cp = cupy_module()
        size = tensor.nbytes() - offset if size is None else size
        start = tensor.offset + offset
        if offset < 0 or size < 0 or start + size > self.size:
            raise ValueError(f"{self.buft.get_name()}: bytes [{start}, {start + size}) outside the buffer "
                             f"of {self.size} bytes")
        return cp.ndarray((size,), dtype=cp.uint8, memptr=self.mem + start)

    def set_tensor(self, tensor: Tensor, data: bytes | np.ndarray, offset: int = 0) -> None:
        src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
            else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._bytes(tensor, offset, src.size).set(src)

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        return self._bytes(tensor, offset, size).get()

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        self._bytes(tensor, offset, size).fill(value)

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        if isinstance(src.buffer, CUDABuffer):
            n = src.nbytes()
            self._bytes(dst, 0, n)[...] = src.buffer._bytes(src, 0, n)
            return True
        return False

    def clear(self, value: int) -> None:
        cupy_module().ndarray((self.size,), dtype=cupy_module().uint8, memptr=self.mem).fill(value)

    def free(self) -> None:
        self.mem = None
        self.size = 0


def tensor_view(t: Tensor):
    """A cupy view of a plain-typed tensor, shaped ne[::-1] with its strides (no copy)."""
    buf = t.buffer
    if not isinstance(buf, CUDABuffer):
        raise ValueError(f"tensor {t.name or '?'} is not in GPU memory")
    cp = cupy_module()
    return cp.ndarray(tuple(reversed(t.ne)), dtype=t.type.np_dtype, memptr=buf.mem + t.offset,
                      strides=tuple(reversed(t.nb)))


def tensor_rows(t: Tensor):
    """A quantized tensor's rows as bytes [ne3, ne2, ne1, row_bytes] (no copy)."""
    buf = t.buffer
    if not isinstance(buf, CUDABuffer):
        raise ValueError(f"tensor {t.name or '?'} is not in GPU memory")
    cp = cupy_module()
    ne, nb = t.ne, t.nb
    return cp.ndarray((ne[3], ne[2], ne[1], t.row_size()), dtype=cp.uint8, memptr=buf.mem + t.offset,
                      strides=(nb[3], nb[2], nb[1], 1))

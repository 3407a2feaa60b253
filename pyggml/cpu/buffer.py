"""Host memory buffers: one ``uint8`` numpy array per buffer, tensors at byte offsets."""
from __future__ import annotations

import numpy as np

from ..backend import Buffer, BufferType, Device, TensorSource
from ..tensor import Tensor
from ..types import Type


class CPUBufferType(BufferType):
    def __init__(self, device: Device | None = None, name: str = "CPU") -> None:
        self.device = device
        self.name = name

    def get_name(self) -> str:
        return self.name

    def alloc_buffer(self, size: int) -> CPUBuffer:
        if size < 0 or size > self.get_max_size():
            raise ValueError(f"{self.name}: cannot allocate {size} bytes")
        try:
            return CPUBuffer(self, np.zeros(size, dtype=np.uint8))
        except MemoryError:
            raise MemoryError(f"{self.name}: out of host memory allocating {size / 2**20:.1f} MiB") from None

    def buffer_from_map(self, data: np.ndarray) -> CPUBuffer:
        """A buffer over existing host bytes (ggml_backend_cpu_buffer_from_ptr), e.g. a
        read-only memory map of a GGUF file: tensors placed in it are read, never written."""
        return CPUBuffer(self, np.asarray(data, dtype=np.uint8).reshape(-1))

    def get_alignment(self) -> int:
        return 64

    def is_host(self) -> bool:
        return True

    def get_device(self) -> Device | None:
        return self.device


MAX_VIEWS = 8192  # views a buffer keeps (see CPUBuffer.view)


class CPUBuffer(Buffer):
    def __init__(self, buft: BufferType, data: np.ndarray) -> None:
        super().__init__(buft, data.size)
        self.data = data
        self._views: dict[tuple, np.ndarray] = {}

    def view(self, type: Type, offset: int, ne: tuple[int, ...], nb: tuple[int, ...]) -> np.ndarray:
        """The numpy view of a plain-typed tensor's bytes at ``offset``, shaped ne[::-1] with its
        strides (numpy checks that it lies in the buffer).  Views are kept, a bounded number:
        every graph plan views a model's weights again, and each of its tensors several times
        (as a node's output and as its users' sources), and a view costs microseconds to make.
        No caller changes a view's shape or flags in place, which is what makes sharing safe."""
        key = (type, offset, ne, nb)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            view = self._views[key] = np.ndarray((ne[3], ne[2], ne[1], ne[0]), dtype=type.np_dtype, buffer=self.data,
                                                 offset=offset, strides=(nb[3], nb[2], nb[1], nb[0]))
        return view

    def _span(self, tensor: Tensor, offset: int, size: int | None) -> slice:
        size = tensor.nbytes() - offset if size is None else size
        start = tensor.offset + offset
        if offset < 0 or size < 0 or start + size > self.size:
            raise ValueError(f"{self.buft.get_name()}: bytes [{start}, {start + size}) outside the buffer "
                             f"of {self.size} bytes")
        return slice(start, start + size)

    def set_tensor(self, tensor: Tensor, data: bytes | np.ndarray, offset: int = 0) -> None:
        src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
            else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self.data[self._span(tensor, offset, src.size)] = src

    def tensor_bytes(self, tensor: Tensor) -> np.ndarray:
        """The tensor's bytes in this buffer, writable in place (a file is read straight into them)."""
        return self.data[self._span(tensor, 0, None)]

    def load_tensor(self, tensor: Tensor, source: TensorSource) -> None:
        """Read straight into place (the file's bytes cross no other buffer)."""
        source.read_into(self.tensor_bytes(tensor))

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        return self.data[self._span(tensor, offset, size)].copy()

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        self.data[self._span(tensor, offset, size)] = value

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        if isinstance(src.buffer, CPUBuffer):
            n = src.nbytes()
            self.data[self._span(dst, 0, n)] = src.buffer.data[src.offset:src.offset + n]
            return True
        return False

    def clear(self, value: int) -> None:
        self.data[:] = value

    def free(self) -> None:
        self._views.clear()
        self.data = np.zeros(0, dtype=np.uint8)
        self.size = 0


def tensor_view(t: Tensor) -> np.ndarray:
    """A numpy view of a plain-typed tensor's bytes, shaped ne[::-1] with its strides (no copy).
    Graph plans make each once (the binders of ops/), not at every step."""
    buf = t.buffer
    if not isinstance(buf, CPUBuffer):
        raise ValueError(f"tensor {t.name or '?'} is not in host memory")
    return buf.view(t.type, t.offset, t.ne, t.nb)


def tensor_rows(t: Tensor) -> np.ndarray:
    """The raw bytes of a (quantized) tensor's rows: uint8 [ne3, ne2, ne1, row_bytes]."""
    buf = t.buffer
    if not isinstance(buf, CPUBuffer):
        raise ValueError(f"tensor {t.name or '?'} is not in host memory")
    ne, nb = t.ne, t.nb
    return np.ndarray((ne[3], ne[2], ne[1], t.row_size()), dtype=np.uint8, buffer=buf.data, offset=t.offset,
                      strides=(nb[3], nb[2], nb[1], 1))

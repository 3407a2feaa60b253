"""The five interfaces of ggml-backend: buffer type, buffer, backend, device, registry.

Method names are ggml's (``alloc_buffer``, ``set_tensor``, ``graph_compute`` ...).  A
backend implementation (numpy CPU, CuPy, RPC) subclasses these; the allocator and
scheduler only ever talk to these interfaces.
"""
from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Iterable, Protocol

import numpy as np

from .batch_rules import BATCH_RULES, BatchRules
from .tensor import Tensor
from .types import Type

if TYPE_CHECKING:
    from .graph import Graph


class DeviceType(enum.IntEnum):
    CPU = 0
    GPU = 1
    ACCEL = 2


class BufferUsage(enum.IntEnum):
    ANY = 0
    WEIGHTS = 1
    COMPUTE = 2


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class BufferType(abc.ABC):
    """Where buffers come from (host memory, one GPU, one remote device)."""

    @abc.abstractmethod
    def get_name(self) -> str: ...

    @abc.abstractmethod
    def alloc_buffer(self, size: int) -> Buffer: ...

    def get_alignment(self) -> int:
        return 32

    def get_max_size(self) -> int:
        return 1 << 62

    def get_alloc_size(self, tensor: Tensor) -> int:
        return tensor.nbytes()

    def is_host(self) -> bool:
        return False

    def get_device(self) -> Device | None:
        return None

    def buffer_from_map(self, data: np.ndarray) -> Buffer | None:
        """ggml's buffer_from_host_ptr: a buffer over memory that already holds the tensors
        (a file's map), so that loading copies nothing; None where this type cannot (not host
        memory)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.get_name()}>"


class TensorSource(Protocol):
    """Where a weight's bytes lie in a model file (pyggml.gguf.FileSlice), for
    :meth:`Buffer.load_tensor`."""

    nbytes: int

    def read(self) -> np.ndarray | memoryview:
        """The bytes, from the file's map or read from the file."""

    def read_into(self, out: np.ndarray) -> None:
        """The bytes, read straight into ``out`` (``nbytes`` long)."""

    def pieces(self) -> list[tuple[int, int, int]]:
        """(offset into the tensor, offset into the file, bytes) of each piece of the bytes."""


class Buffer(abc.ABC):
    """One allocation; tensors live in it at byte offsets (``tensor.offset``)."""

    def __init__(self, buft: BufferType, size: int) -> None:
        self.buft = buft
        self.size = size
        self.usage = BufferUsage.ANY

    def get_size(self) -> int:
        return self.size

    def get_type(self) -> BufferType:
        return self.buft

    def get_base(self) -> int:
        return 0  # offsets are relative: a tensor's place is (buffer, offset)

    def init_tensor(self, tensor: Tensor) -> None:
        """Called when a tensor is placed in this buffer; views share their source's bytes."""
        if tensor.view_src is not None:
            tensor.buffer = tensor.view_src.buffer
            tensor.offset = tensor.view_src.offset + tensor.view_offs

    @abc.abstractmethod
    def set_tensor(self, tensor: Tensor, data: bytes | np.ndarray, offset: int = 0) -> None: ...

    @abc.abstractmethod
    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray: ...

    def get_tensors(self, tensors: list[Tensor]) -> list[np.ndarray]:
        """Several whole tensors' bytes (each in a buffer of this type); a buffer that pays per
        request, as a remote one does, asks for them together."""
        return [t.buffer.get_tensor(t, 0, t.nbytes()) for t in tensors]

    def get_tensors_async(self, tensors: list[Tensor]) -> Callable[[], list[np.ndarray]]:
        """get_tensors, whose answer is read when the function returned is called (ggml's
        tensor_get_async and synchronize): the bytes are those of the tensors now, even if
        later work overwrites them first.  A buffer that waits for its answers (a remote one)
        asks now and reads later; by default the bytes are read now."""
        arrays = self.get_tensors(tensors)
        return lambda: arrays

    @abc.abstractmethod
    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None: ...

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        """Copy between buffers without a host round trip where possible; False if not."""
        return False

    def cpy_tensor_send(self, src: Tensor, dst: Tensor) -> int | None:
        """The first half of a copy started early (as soon as ``src`` is computed, before the
        scheduler reaches ``dst``'s split): a tag for :meth:`cpy_tensor_wait`, or None where
        this buffer cannot (then cpy_tensor does the whole copy when it is reached)."""
        return None

    def cpy_tensor_wait(self, dst: Tensor, tag: int) -> None:
        """The second half of a copy that :meth:`cpy_tensor_send` started."""
        raise NotImplementedError(f"{type(self).__name__} starts no copies early")

    def load_tensor(self, tensor: Tensor, source: TensorSource) -> None:
        """Fill a weight from its model file.  By default its bytes are read and set; host
        memory reads straight into place, and a remote device whose server holds the same
        file reads it from its own disk."""
        self.set_tensor(tensor, source.read())

    def load_summary(self) -> str | None:
        """Where this buffer's weights came from, said once loading ends; None if not worth saying."""
        return None

    @abc.abstractmethod
    def clear(self, value: int) -> None: ...

    def free(self) -> None:
        pass

    def set_usage(self, usage: BufferUsage) -> None:
        self.usage = usage

    def is_host(self) -> bool:
        return self.buft.is_host()


class Backend(abc.ABC):
    """Something that executes graphs (one stream of one device)."""

    @abc.abstractmethod
    def get_name(self) -> str: ...

    @abc.abstractmethod
    def graph_compute(self, graph: Graph) -> None: ...

    def graph_plan_create(self, graph: Graph) -> object:
        """ggml_backend_graph_plan_create: what this backend derives once from a graph it will
        compute again and again (by default nothing: the plan is the graph)."""
        return graph

    def graph_plan_compute(self, plan: object) -> None:
        self.graph_compute(plan)

    def synchronize(self) -> None:
        pass

    def set_n_threads(self, n: int) -> None:
        """How many threads compute (ggml_backend_cpu_set_n_threads); ignored where the
        backend has no threads to set."""

    def keeps_steps(self) -> bool:
        """Whether this backend can record a step's requests and keep them to run again with
        one request (an RPC server: rpc/steps.py), through step_begin/step_end/step_valid/step_run."""
        return False

    def set_tensor_async(self, tensor: Tensor, data: bytes | np.ndarray, offset: int = 0) -> None:
        tensor_set(tensor, data, offset)

    def get_tensor_async(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        return tensor_get(tensor, offset, size)

    @abc.abstractmethod
    def get_device(self) -> Device: ...

    def get_default_buffer_type(self) -> BufferType:
        return self.get_device().get_buffer_type()

    def supports_op(self, op: Tensor) -> bool:
        return self.get_device().supports_op(op)

    def free(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.get_name()}>"


class Device(abc.ABC):
    """A place that can hold tensors and run graphs: a CPU, a GPU, a remote device."""

    @abc.abstractmethod
    def get_name(self) -> str: ...

    @abc.abstractmethod
    def get_description(self) -> str: ...

    @abc.abstractmethod
    def get_memory(self) -> tuple[int, int]:
        """(free, total) bytes."""

    @abc.abstractmethod
    def get_type(self) -> DeviceType: ...

    @abc.abstractmethod
    def init_backend(self) -> Backend: ...

    @abc.abstractmethod
    def get_buffer_type(self) -> BufferType: ...

    @abc.abstractmethod
    def supports_op(self, op: Tensor) -> bool: ...

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.get_device() is self

    def get_host_buffer_type(self) -> BufferType | None:
        return None

    def limitations(self) -> list[str]:
        """What this device lacks that the others of its kind have, for the placement's
        description (a llama.cpp rpc-server: no TLS, LZ4, --gguf or links)."""
        return []

    def prepare_for(self, weights: Sequence[tuple[str, Type, tuple[int, ...]]], gate: str | None,
                    say: Callable[[str], None] | None = None) -> Preparation | None:
        """Start what this device needs before it computes a model with these weights (name,
        type, ne) and feed-forward ``gate`` (an op's name, e.g. ``swiglu``): the CPU compiles
        its kernels in other processes.  Something to wait on before the model's first step,
        or None when nothing is to be done (``say`` hears one line when something is)."""
        return None

    def batch_rules(self, products: Collection[Type] = ()) -> BatchRules:
        """The batch widths that decide this device's kernels for products of weights of these
        types (pyggml.batch_rules): by default those that hold for any."""
        return BATCH_RULES

    def connection(self) -> Connection | None:
        """The connection to the server this device lives on (devices of one server share
        it); None for a device in this process."""
        return None

    def get_speed(self) -> float | None:
        """GB/s of weights through a product, as measured where the device is (pyggml.speed);
        None where unknown."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.get_name()}>"


class Preparation(Protocol):
    """Work a device started for a model (Device.prepare_for)."""

    def wait_for_first_answer(self) -> None:
        """Until what the model's first step needs is done (the rest may go on)."""


class Connection(Protocol):
    """What the rest of pyggml reads of a remote device's connection (rpc.client.Connection)."""

    endpoint: str
    rtt: float  # seconds, one round trip as measured at HELLO
    bytes_sent: int
    bytes_received: int


class Registry:
    """The devices this process knows about (ggml_backend_reg + dev list)."""

    def __init__(self) -> None:
        self._devices: list[Device] = []

    def register(self, device: Device) -> None:
        if all(d.get_name() != device.get_name() for d in self._devices):
            self._devices.append(device)

    def devices(self) -> list[Device]:
        return list(self._devices)

    def get(self, name: str) -> Device:
        for d in self._devices:
            if d.get_name().lower() == name.lower():
                return d
        raise KeyError(f"no device named {name!r}; devices: {', '.join(d.get_name() for d in self._devices)}")


# -- tensor data helpers (ggml_backend_tensor_set/get/memset/copy) --------------------------

def _require_buffer(tensor: Tensor) -> Buffer:
    if tensor.buffer is None:
        raise ValueError(f"tensor {tensor.name or '?'} has no buffer: allocate it first")
    return tensor.buffer


def tensor_set(tensor: Tensor, data: bytes | np.ndarray, offset: int = 0) -> None:
    """Write bytes (or an array's bytes) into a tensor, checking they fit."""
    buf = _require_buffer(tensor)
    n = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else np.asarray(data).nbytes
    if offset < 0 or offset + n > tensor.nbytes():
        raise ValueError(f"tensor_set: {n} bytes at offset {offset} do not fit {tensor.name or '?'} "
                         f"({tensor.nbytes()} bytes)")
    buf.set_tensor(tensor, data, offset)


def tensor_get(tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
    """The tensor's bytes as a uint8 array (a copy)."""
    buf = _require_buffer(tensor)
    size = tensor.nbytes() - offset if size is None else size
    if offset < 0 or size < 0 or offset + size > tensor.nbytes():
        raise ValueError(f"tensor_get: {size} bytes at offset {offset} outside {tensor.name or '?'}")
    return buf.get_tensor(tensor, offset, size)


def tensor_memset(tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
    _require_buffer(tensor).memset_tensor(tensor, value, offset, size)


def tensor_copy(src: Tensor, dst: Tensor) -> None:
    """ggml_backend_tensor_copy: same bytes, any two buffers."""
    if src.nbytes() != dst.nbytes():
        raise ValueError(f"tensor_copy: sizes differ ({src.nbytes()} vs {dst.nbytes()} bytes)")
    if src.buffer is dst.buffer and src.offset == dst.offset:
        return
    dst_buf = _require_buffer(dst)
    if dst_buf.cpy_tensor(src, dst):
        return
    tensor_set(dst, tensor_get(src))


def tensor_array(tensor: Tensor) -> np.ndarray:
    """A tensor's values as a numpy array shaped ne[::-1] (quantized types come back as float32)."""
    return _values(tensor, tensor_get(tensor))


def tensor_arrays(tensors: Sequence[Tensor]) -> list[np.ndarray]:
    """:func:`tensor_array` of several tensors, read together where their buffers can (one
    round trip to an RPC server for a decode step's outputs)."""
    return tensor_arrays_async(tensors)()


def tensor_arrays_async(tensors: Sequence[Tensor]) -> Callable[[], list[np.ndarray]]:
    """:func:`tensor_arrays` of the tensors as they are now, read when the function returned
    is called (Buffer.get_tensors_async): a remote buffer's answer can then come while the
    next graph is sent."""
    by_type: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        by_type.setdefault(id(_require_buffer(t).get_type()), []).append(i)
    reads = [(idx, tensors[idx[0]].buffer.get_tensors_async([tensors[i] for i in idx])) for idx in by_type.values()]

    def arrays() -> list[np.ndarray]:
        raws: list = [None] * len(tensors)
        for idx, read in reads:
            for i, raw in zip(idx, read()):
                raws[i] = raw
        return [_values(t, raw) for t, raw in zip(tensors, raws)]
    return arrays


def _values(tensor: Tensor, raw: np.ndarray) -> np.ndarray:
    if tensor.type.is_quantized or tensor.type == Type.BF16:
        if not tensor.is_contiguous():
            raise ValueError(f"tensor_array: {tensor.name or '?'} is a non-contiguous {tensor.type.name} view")
        from . import quants
        return quants.dequantize(raw.reshape(-1, tensor.row_size()), tensor.type).reshape(tensor.ne[::-1])
    root = np.lib.stride_tricks.as_strided(raw.view(np.uint8), shape=tuple(reversed(tensor.ne)) + (tensor.type.type_size,),
                                           strides=tuple(reversed(tensor.nb)) + (1,))
    return np.ascontiguousarray(root).view(tensor.type.np_dtype)[..., 0]


def alloc_tensors(tensors: Iterable[Tensor], buft: BufferType, usage: BufferUsage = BufferUsage.WEIGHTS) -> Buffer:
    """Place tensors one after another in one new buffer (ggml_backend_alloc_ctx_tensors_from_buft)."""
    tensors = [t for t in tensors if t.view_src is None]
    align = buft.get_alignment()
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size = align_up(size + buft.get_alloc_size(t), align)
    buffer = buft.alloc_buffer(max(size, align))
    buffer.set_usage(usage)
    for t, off in zip(tensors, offsets):
        t.buffer, t.offset = buffer, off
        buffer.init_tensor(t)
    return buffer

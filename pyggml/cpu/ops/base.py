"""What every op family's binders share: reading and writing tensors as float32, row kernels over any shape, values a plan shares between steps."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import quants
from ...tensor import Tensor
from ...types import Type
from ..activations import block_kind, pack
from ..buffer import tensor_rows, tensor_view
from ..qdecode import F16_TABLE, f16_values



f32 = np.float32


Step = Callable[[], None]


Read = Callable[[], np.ndarray]


Binder = Callable[[Tensor, dict], Step]


def _f16_floats(view: np.ndarray) -> np.ndarray:
    """float32 values of a 4-d float16 view (any strides), through the half table."""
    out = np.empty(view.shape, dtype=f32)
    f16_values(view.view(np.uint16), F16_TABLE, out)
    return out


def reader(t: Tensor) -> Read:
    """A function giving t's values as float32 [ne3, ne2, ne1, ne0] each time it is called (the
    view itself when t is F32; a conversion of the bytes otherwise)."""
    if t.type == Type.F32:
        view = tensor_view(t)
        return lambda: view
    if t.type == Type.F16:
        view = tensor_view(t)
        return lambda: _f16_floats(view)
    if t.type.np_dtype is not None and t.type != Type.BF16:
        view = tensor_view(t)
        return lambda: view.astype(f32)
    rows, shape, qtype = tensor_rows(t), t.ne[::-1], t.type
    return lambda: quants.dequantize(rows.reshape(-1, rows.shape[-1]), qtype).reshape(shape)


def writer(dst: Tensor) -> Callable[[np.ndarray], None]:
    """A function writing float values into dst, converting to dst's type (quantizing row by row)."""
    shape = dst.ne[::-1]
    if dst.type.np_dtype is not None and dst.type != Type.BF16:
        view = tensor_view(dst)

        def write(x: np.ndarray) -> None:
            view[...] = x.reshape(shape)
        return write
    rows, qtype = tensor_rows(dst), dst.type
    kind = block_kind(qtype)
    if kind is not None:  # Q8_0, Q8_1, Q8_K: ggml's CPU from_float, what its products make of their activations
        def write_activations(x: np.ndarray) -> None:
            rows[...] = pack(np.asarray(x, dtype=f32).reshape(-1, dst.ne[0]), kind).reshape(rows.shape)
        return write_activations

    def write_quantized(x: np.ndarray) -> None:
        rows[...] = quants.quantize(np.ascontiguousarray(x, dtype=f32).reshape(shape), qtype)
    return write_quantized


def _broadcasts(b_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return b_shape == shape or all(x in (1, y) for x, y in zip(b_shape, shape))


def _tile(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml's broadcasting: b repeats to fill shape (each of b's dims divides shape's)."""
    if _broadcasts(b.shape, shape):
        return b
    return np.tile(b, tuple(y // x for x, y in zip(b.shape, shape)))


def _rows(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=f32).reshape(-1, x.shape[-1])


def _row_view(t: Tensor) -> np.ndarray | None:
    """t's values as float32 rows [rows, ne0], the tensor's own bytes, when it is a contiguous
    F32 tensor (a binder then hands a row kernel the same arrays at every step, with nothing to
    convert or check); None otherwise."""
    if t.type != Type.F32:
        return None
    view = tensor_view(t)
    return view.reshape(-1, t.ne[0]) if view.flags.c_contiguous else None


def _by_rows(kernel: Callable, *inputs: np.ndarray, params: tuple = (), out: np.ndarray | None = None) -> np.ndarray:
    """A numba row kernel of nn.py (``kernel(*rows, *params, out)``) over arrays of any shape;
    straight into ``out`` when it is a contiguous float32 array of the inputs' shape."""
    shape = inputs[0].shape
    direct = out is not None and out.shape == shape and out.dtype == f32 and out.flags.c_contiguous
    res = out if direct else np.empty(shape, dtype=f32)
    kernel(*(_rows(x) for x in inputs), *params, res.reshape(-1, shape[-1]))
    if out is not None and not direct:
        out[...] = res
    return res


class _SharedValue:
    """A value several steps of a plan need (one activation in the form several products take
    it; RoPE's angles): computed by the first (``compute``), read by the ones after it in graph
    order (``take``) - each step runs after the first's - and let go by the last, so that a plan
    holds no step's values between steps."""
    __slots__ = ("value", "readers", "left")

    def __init__(self) -> None:
        self.value, self.readers, self.left = None, 0, 0

    def compute(self, make: Callable[[], object]):
        value = make()
        if self.readers:
            self.value, self.left = value, self.readers
        return value

    def take(self):
        value = self.value
        self.left -= 1
        if self.left == 0:
            self.value = None
        return value


def _shared_value(shared: dict, key: tuple, make: Callable[[], object]) -> Callable[[], object]:
    """A step's value under ``key``, made once per step for every step of the plan that asks
    for it (the first to bind makes it: binding follows graph order)."""
    slot = shared.get(key)
    if slot is not None:
        slot.readers += 1
        return slot.take
    slot = shared[key] = _SharedValue()
    return lambda: slot.compute(make)

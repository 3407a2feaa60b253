"""Elementwise ops: ADD/SUB/MUL/DIV, SCALE, UNARY, GLU, ADD_ID, CPY/CONT/DUP, CONCAT, SUM_ROWS, CLAMP."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ...opdefs import (ClampParams, ConcatParams, GluOp, GluParams, ScaleParams, UnaryOp, UnaryParams)
from ...tensor import Tensor
from .. import nn, router
from ..activations import SERIAL_ROWS, block_kind, pack_call
from ..buffer import tensor_rows, tensor_view
from ..parts import GATES, part, sample_x
from ..plan import TableStep
from ..rows import RowCall

from .base import f32, Step, Binder, reader, writer, _broadcasts, _tile, _row_view, _by_rows


def _binary(fn: Callable[..., np.ndarray], op: int) -> Binder:
    def bind(node: Tensor, shared: dict) -> Step:
        a_rows, b_rows, out_rows = (_row_view(t) for t in (node.src[0], node.src[1], node))
        if (a_rows is not None and b_rows is not None and out_rows is not None and a_rows.shape == out_rows.shape
                and b_rows.shape[0] in (1, a_rows.shape[0])):
            if b_rows.shape[1] == a_rows.shape[1]:
                return TableStep(lambda: [nn.elementwise_call(op, a_rows, b_rows, out_rows)])  # rows, or rows by one row
            if b_rows.shape[1] == 1:  # a value of b for each row (an expert's output by its weight)
                return TableStep(lambda: [router.row_value_call(op, a_rows, b_rows, out_rows)])
        a, b = reader(node.src[0]), reader(node.src[1])
        out = tensor_view(node)
        if _broadcasts(node.src[1].ne[::-1], out.shape):
            return lambda: fn(a(), b(), out=out)
        return lambda: fn(a(), _tile(b(), out.shape), out=out)
    return bind


def bind_scale(node: Tensor, shared: dict) -> Step:
    p = ScaleParams.of(node)
    scale, bias = f32(p.scale), f32(p.bias)
    x_rows, out_rows = _row_view(node.src[0]), _row_view(node)
    if x_rows is not None and out_rows is not None and x_rows.shape == out_rows.shape:
        return TableStep(lambda: [nn.elementwise_call(nn.SCALE, x_rows, None, out_rows, scale, bias)])
    x, out = reader(node.src[0]), tensor_view(node)

    def step() -> None:
        np.multiply(x(), scale, out=out)
        if bias:
            out[...] += bias
    return step


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    from math import erf
    return (f32(0.5) * x * (f32(1) + np.vectorize(erf, otypes=[np.float64])(x / math.sqrt(2)))).astype(f32)


def _hardsigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(f32(1), np.maximum(f32(0), (x + f32(3)) / f32(6)))


# SiLU and GELU with ggml's rounding (nn.py); the others as numpy computes them
UNARY: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    UnaryOp.ABS: np.abs,
    UnaryOp.NEG: np.negative,
    UnaryOp.TANH: np.tanh,
    UnaryOp.RELU: lambda x: np.maximum(x, f32(0)),
    UnaryOp.SIGMOID: lambda x: f32(1) / (f32(1) + np.exp(-x)),
    UnaryOp.GELU: lambda x: _by_rows(nn.gelu, x),
    UnaryOp.GELU_QUICK: lambda x: x / (f32(1) + np.exp(f32(-1.702) * x)),
    UnaryOp.SILU: lambda x: _by_rows(nn.silu, x),
    UnaryOp.EXP: np.exp,
    UnaryOp.EXPM1: np.expm1,
    UnaryOp.SOFTPLUS: lambda x: np.where(x > f32(20), x, np.log(f32(1) + np.exp(x))),  # ggml's, cut at 20
    UnaryOp.GELU_ERF: _gelu_erf,
    UnaryOp.SGN: np.sign,
    UnaryOp.STEP: lambda x: (x > f32(0)).astype(f32),
    UnaryOp.ELU: lambda x: np.where(x > f32(0), x, np.expm1(x)),
    UnaryOp.HARDSIGMOID: lambda x: _hardsigmoid(x),
    UnaryOp.HARDSWISH: lambda x: x * _hardsigmoid(x),
}


def _swiglu_oai(a: np.ndarray, b: np.ndarray, out: np.ndarray, alpha: float, limit: float) -> None:
    """ggml's swiglu_oai, float32 step by step (expf correctly rounded, as glibc's)."""
    alpha, limit = f32(alpha), f32(limit)
    x = np.minimum(a, limit)
    y = np.clip(b, -limit, limit)
    e = np.exp((alpha * -x).astype(np.float64)).astype(f32)
    np.multiply(x / (f32(1) + e), y + f32(1), out=out)


GLU: dict[int, Callable[..., np.ndarray]] = {
    GluOp.SWIGLU_OAI: _swiglu_oai,
    GluOp.REGLU: lambda a, b, out: np.multiply(np.maximum(a, f32(0)), b, out=out),
    GluOp.SWIGLU: lambda a, b, out: _by_rows(nn.swiglu, a, b, out=out),  # activation and product in one pass
    GluOp.GEGLU: lambda a, b, out: _by_rows(nn.geglu, a, b, out=out),
}


def bind_unary(node: Tensor, shared: dict) -> Step:
    fn, x, out = UNARY[UnaryParams.of(node).op], reader(node.src[0]), tensor_view(node)

    def step() -> None:
        out[...] = fn(x())
    return step


# the GLUs whose kernels take rows, as calls (GLU's forms for arrays of any shape call them by rows)
ROW_GLU: dict[int, Callable[..., RowCall]] = {
    GluOp.SWIGLU: lambda a, b, out, p: nn.swiglu_call(a, b, out),
    GluOp.GEGLU: lambda a, b, out, p: nn.geglu_call(a, b, out),
    GluOp.SWIGLU_OAI: lambda a, b, out, p: nn.swiglu_oai_call(a, b, out, p.alpha, p.limit),
}


def bind_glu(node: Tensor, shared: dict) -> Step:
    p = GluParams.of(node)
    if p.op in ROW_GLU and node.src[1] is not None:  # a feed-forward's gate and up, apart
        a, b, out_rows = (_row_view(t) for t in (node.src[0], node.src[1], node))
        if a is not None and b is not None and out_rows is not None:
            call = ROW_GLU[p.op]
            if p.swapped:
                a, b = b, a
            return TableStep(lambda: [call(a, b, out_rows, p)])
    fn, out = GLU[p.op], tensor_view(node)
    first = reader(node.src[0])
    if node.src[1] is None:  # gate and value side by side in one tensor
        half = node.src[0].ne[0] // 2

        def halves() -> tuple[np.ndarray, np.ndarray]:
            v = first()
            return v[..., :half], v[..., half:]
    else:
        second = reader(node.src[1])

        def halves() -> tuple[np.ndarray, np.ndarray]:
            return first(), second()

    extra = (p.alpha, p.limit) if p.op == GluOp.SWIGLU_OAI else ()

    def step() -> None:
        a, b = halves()
        if p.swapped:
            a, b = b, a
        fn(a, b, out, *extra)
    return step


def bind_add_id(node: Tensor, shared: dict) -> Step:
    out, n_expert = tensor_view(node), node.src[1].ne[1]
    a_view, b_view, ids_view = (tensor_view(t) for t in node.src[:3])
    if a_view.flags.c_contiguous and out.flags.c_contiguous:  # each chosen expert's bias, picked by id and added
        picks = router.PickedRows(b_view, ids_view[0], out[0][None], lambda bad: ValueError(
            f"ADD_ID: id {bad} outside 0..{n_expert - 1}"), add=a_view[0][None])
        return TableStep(lambda: [picks.call()], picks.clear, hold=(picks,), check=picks.check)
    a, b, ids = (reader(t) for t in node.src[:3])

    def step() -> None:
        idx = ids()[0, 0].astype(np.int64)      # [n_tokens, n_used]
        bad = idx[(idx < 0) | (idx >= n_expert)]
        if bad.size:
            raise ValueError(f"ADD_ID: id {int(bad[0])} outside 0..{n_expert - 1}")
        out[0] = a()[0] + b()[0, 0][idx]        # [n_tokens, n_used, n]
    return step


def bind_cpy(node: Tensor, shared: dict) -> Step:
    """CPY/CONT/DUP: same values, possibly another type and another layout."""
    src = node.src[0]
    shape = node.ne[::-1]
    if src.type == node.type and node.type.np_dtype is not None:
        view, out = tensor_view(src), tensor_view(node)
        flat = view.reshape(shape) if src.is_contiguous() else None
        if flat is not None and np.may_share_memory(flat, view):  # a view of the source, not a copy of it now
            return lambda: out.__setitem__(Ellipsis, flat)
        return lambda: out.__setitem__(Ellipsis, np.ascontiguousarray(view).reshape(shape))
    x_rows = _row_view(src)
    kind = block_kind(node.type)
    if kind is not None and x_rows is not None and node.is_contiguous():  # (ops.cast: a tensor split's slice)
        blocks = tensor_rows(node).reshape(x_rows.shape[0], -1)
        return TableStep(lambda: [pack_call(x_rows, kind, blocks, threads=x_rows.shape[0] > SERIAL_ROWS)])
    x, write = reader(src), writer(node)
    return lambda: write(x())


def bind_concat(node: Tensor, shared: dict) -> Step:
    axis = 3 - ConcatParams.of(node).dim
    if node.type.is_quantized:  # whole blocks: their bytes joined (ops.concat)
        qa, qb, q_out = tensor_rows(node.src[0]), tensor_rows(node.src[1]), tensor_rows(node)
        return lambda: q_out.__setitem__(Ellipsis, np.concatenate([qa, qb], axis=axis))
    a, b, out = reader(node.src[0]), reader(node.src[1]), tensor_view(node)
    return lambda: out.__setitem__(Ellipsis, np.concatenate([a(), b()], axis=axis))


def bind_sum_rows(node: Tensor, shared: dict) -> Step:
    """Rows summed in double, then rounded (ggml_vec_sum_f32 accumulates in ggml_float)."""
    x_rows, out_rows = _row_view(node.src[0]), _row_view(node)
    if x_rows is not None and out_rows is not None and out_rows.shape == (x_rows.shape[0], 1):
        return TableStep(lambda: [router.sum_rows_call(x_rows, out_rows)])
    x, out = reader(node.src[0]), tensor_view(node)
    return lambda: out.__setitem__(Ellipsis, x().sum(axis=-1, keepdims=True, dtype=np.float64).astype(f32))


def bind_clamp(node: Tensor, shared: dict) -> Step:
    p = ClampParams.of(node)
    x_rows, out_rows = _row_view(node.src[0]), _row_view(node)
    if x_rows is not None and out_rows is not None and x_rows.shape == out_rows.shape:
        return TableStep(lambda: [router.clamp_call(x_rows, out_rows, p.min, p.max)])
    x, out, lo, hi = reader(node.src[0]), tensor_view(node), f32(p.min), f32(p.max)
    return lambda: np.clip(x(), lo, hi, out=out)


@part("swiglu_oai", 0.3, GATES)
def _compile_swiglu_oai() -> None:
    """gpt-oss's gate: its row kernel (a call made, not run); the numpy form has nothing to compile."""
    x = sample_x(2)
    nn.swiglu_oai_call(x, x, np.empty_like(x), 1.702, 7.0)

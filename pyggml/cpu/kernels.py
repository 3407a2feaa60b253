"""The CPU backend's op table: for each op a binder, which turns a node into a step.

A binder takes an allocated node and returns its step: a function of no arguments that
computes the node in place, in float32.  What does not depend on the data is resolved when
the binder runs - the numpy views of the node's sources and result (``tensor_view``), its
parameters, which kernel to call and how its arguments are laid out - so that a graph plan
(``CPUBackend.graph_plan_create``), which binds every node once, pays per step only for the
kernels and the checks that read the data (indices in range, the cells a mask shows).
Computing one node op by op is ``bind(node)()``: the same step, made and dropped.

Where a node's kernels take arrays that stay where they are from step to step (a decoding
step's, mostly), its step is a plan.TableStep: the kernels' calls with their arguments
resolved, which the plan runs together with its neighbours' in one compiled call; what such
a step must work out from the graph's inputs at every run (RoPE's angles, the mask's cells,
the row ids' check) it does in its ``prepare``, into arrays its calls read.

``shared`` is the plan's: a binder may leave there what a later node of the same graph can
reuse (the products of one activation with several weights convert it once).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .. import quants, ranking
from ..opdefs import (ArgsortParams, ClampParams, ConcatParams, FlashAttnParams, GluOp, GluParams, NormParams, Op, RopeMode,
                      RopeParams, ScaleParams, SoftMaxParams, SortOrder, UnaryOp, UnaryParams)
from ..tensor import Tensor
from ..types import Type
from . import nn
from .buffer import tensor_rows, tensor_view
from .kinds import DECODER
from .activations import SERIAL_ROWS, activation_shapes, quantize_call
from .plan import ArrayPool, TableStep
from .qdecode import F16_TABLE, decode_rows_call, f16_values
from .qdot import activation_bytes_width, exact_quant_matmul_id, lane_sums, product_calls
from .qmatmul import QuantProduct, dequantize_rows, frozen, whole
from .qmatmul import supports as quant_supported
from .rows import RowCall

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


def _binary(fn: Callable[..., np.ndarray], op: int) -> Binder:
    def bind(node: Tensor, shared: dict) -> Step:
        a_rows, b_rows, out_rows = (_row_view(t) for t in (node.src[0], node.src[1], node))
        if (a_rows is not None and b_rows is not None and out_rows is not None and a_rows.shape == out_rows.shape
                and b_rows.shape[1] == a_rows.shape[1] and b_rows.shape[0] in (1, a_rows.shape[0])):
            return TableStep(lambda: [nn.elementwise_call(op, a_rows, b_rows, out_rows)])  # rows, or rows by one row
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
ROW_GLU: dict[int, Callable[..., RowCall]] = {GluOp.SWIGLU: nn.swiglu_call, GluOp.GEGLU: nn.geglu_call}


def bind_glu(node: Tensor, shared: dict) -> Step:
    p = GluParams.of(node)
    if p.op in ROW_GLU and node.src[1] is not None:  # a feed-forward's gate and up, apart
        a, b, out_rows = (_row_view(t) for t in (node.src[0], node.src[1], node))
        if a is not None and b is not None and out_rows is not None:
            call = ROW_GLU[p.op]
            if p.swapped:
                a, b = b, a
            return TableStep(lambda: [call(a, b, out_rows)])
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


def bind_rms_norm(node: Tensor, shared: dict) -> Step:
    x, out, eps = reader(node.src[0]), tensor_view(node), NormParams.of(node).eps
    x_rows, out_rows = _row_view(node.src[0]), _row_view(node)
    if x_rows is not None and out_rows is not None:
        return TableStep(lambda: [nn.rms_norm_call(x_rows, eps, out_rows)])
    return lambda: _by_rows(nn.rms_norm, x(), params=(eps,), out=out)


def bind_norm(node: Tensor, shared: dict) -> Step:
    x, out, eps = reader(node.src[0]), tensor_view(node), NormParams.of(node).eps

    def step() -> None:
        v = x().astype(np.float64)
        centered = v - v.mean(axis=-1, keepdims=True)
        out[...] = centered / np.sqrt(np.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return step


def bind_soft_max(node: Tensor, shared: dict) -> Step:
    a, mask = node.src[0], node.src[1]
    sinks = node.src[2] if len(node.src) > 2 else None
    x, out, scale = reader(a), tensor_view(node), f32(SoftMaxParams.of(node).scale)
    m = reader(mask) if mask is not None else None
    s = reader(sinks) if sinks is not None else None
    n_rows = a.ne[1]

    def step() -> None:
        v = x() * scale
        if m is not None:
            v += _tile(m()[:, :, :n_rows, :], v.shape)
        rows = np.ascontiguousarray(v).reshape(-1, v.shape[-1])
        if s is None:
            nn.softmax_rows(rows)
        else:  # the sink of each row's head (ne[2])
            per_row = np.broadcast_to(s().reshape(-1)[None, :, None], v.shape[:3]).reshape(-1)
            nn.softmax_rows_sinks(rows, np.ascontiguousarray(per_row, dtype=f32))
        out[...] = rows.reshape(v.shape)
    return step


def bind_add_id(node: Tensor, shared: dict) -> Step:
    a, b, ids = (reader(t) for t in node.src[:3])
    out, n_expert = tensor_view(node), node.src[1].ne[1]

    def step() -> None:
        idx = ids()[0, 0].astype(np.int64)      # [n_tokens, n_used]
        bad = idx[(idx < 0) | (idx >= n_expert)]
        if bad.size:
            raise ValueError(f"ADD_ID: id {int(bad[0])} outside 0..{n_expert - 1}")
        out[0] = a()[0] + b()[0, 0][idx]        # [n_tokens, n_used, n]
    return step


def bind_rope(node: Tensor, shared: dict) -> Step:
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    p = RopeParams.of(node)
    factors = tensor_view(ff) if ff is not None else np.ones(1, dtype=f32)
    positions, x, out = tensor_view(pos), reader(a), tensor_view(node)
    neox = p.mode == RopeMode.NEOX
    # rope_rotate reads each pair before it writes it: the result may go straight into out
    direct = out.flags.c_contiguous

    def rope_angles() -> tuple[np.ndarray, np.ndarray]:
        return nn.rope_cache(positions.reshape(-1).astype(np.int64), p.n_dims, p.freq_base, p.freq_scale, p.ext_factor,
                             p.attn_factor, p.beta_fast, p.beta_slow, p.n_ctx_orig, factors.reshape(-1), ff is not None)

    xv = _row_view(a)
    if xv is not None and direct and a.ne[::-1] == out.shape:
        # as a table's call: the angles in arrays of the plan's, computed by the first ROPE of
        # the plan (before its table runs) and read by the others with the same positions
        key = ("rope table", id(pos), id(ff), p)
        first = key not in shared
        if first:
            shared[key] = tuple(np.empty((positions.size, p.n_dims // 2), dtype=f32) for _ in range(2))
        cos, sin = shared[key]

        def prepare() -> None:
            c, s = rope_angles()
            cos[...], sin[...] = c, s
        x4 = xv.reshape(out.shape)
        return TableStep(lambda: [nn.rope_call(x4, out, cos, sin, p.n_dims, neox)],
                         prepare if first else None, reads=(pos, ff) if ff is not None else (pos,))

    # the angles of the step's positions, computed by the first ROPE of the plan and taken by
    # the others with the same positions and parameters (every layer's Q and K)
    angles = _shared_value(shared, ("rope", id(pos), id(ff), p), rope_angles)

    def step() -> None:
        cos, sin = angles()
        v = np.ascontiguousarray(x())  # [ne3, n_tokens, n_head, head_dim]
        if direct:
            nn.rope_rotate(v, out, cos, sin, p.n_dims, neox)
            return
        res = np.empty(v.shape, dtype=f32)
        nn.rope_rotate(v, res, cos, sin, p.n_dims, neox)
        out[...] = res
    return step


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


def float_rows(t: Tensor) -> np.ndarray:
    """An F32 tensor's values as rows [rows, ne0] (a view when its rows lie one after another,
    else an empty array: quant_table_step then declines)."""
    if t.type != Type.F32 or not t.is_contiguous():
        return np.empty((0, max(t.ne[0], 1)), dtype=f32)
    return tensor_view(t).reshape(-1, t.ne[0])


def _shared_activations(shared: dict, b: Tensor, product: QuantProduct, x: Read) -> Callable[[], object]:
    """The activations of b for ``product``, converted once per step for every product of the
    plan that reads b in the same form."""
    width = b.ne[0]
    return _shared_value(shared, ("activations", id(b), product.activation_key),
                         lambda: product.activations(x().reshape(-1, width)))


def _checked_runs(node: Tensor, t: Tensor, n_cols: int, shared: dict) -> tuple[np.ndarray, Callable[[], None] | None]:
    """MUL_MAT's runs (column_runs') as int64 in an array of the plan's that table calls read,
    and what fills and checks it before they run (for the first step of the plan that reads t;
    the others None)."""
    key = ("checked runs", id(t), n_cols)
    if key in shared:
        return shared[key], None
    runs = column_runs(node, t, n_cols)
    checked = shared[key] = np.empty(t.nelements(), dtype=np.int64)

    def prepare() -> None:
        checked[...] = runs()
    return checked, prepare


def quant_table_step(shared: dict, product: QuantProduct, node: Tensor, b: Tensor, runs_t: Tensor | None,
                     out: Callable[[], np.ndarray], then: Callable[[np.ndarray], list[RowCall]] | None = None,
                     hold: tuple = ()) -> TableStep | None:
    """A product of exact weights (``product``) with the F32 rows of b into ``out()`` (made when
    the plan's tables are, C-contiguous [columns, M] or wider), as calls of a plan's table: b
    quantized by the first product of the plan that reads it in this form, into arrays of the
    plan's (plan.ArrayPool) that the others read; the activations' bytes; the rows; then
    ``then(out)``'s calls.  None where the calls cannot take it (other weights, b not rows one
    after another, runs computed in the graph)."""
    x = float_rows(b)
    n_cols, k = x.shape
    if not (product.exact and product.m_rows > 0 and n_cols > 0 and product.qtype.row_size(k) == product.w.shape[1]):
        return None
    pool = shared.setdefault("activation pool", ArrayPool())
    key = ("table activations", id(b), product.activation_key)
    quantizes = key not in shared  # (binding follows the plan's order)
    shared[key] = True
    acts = pool.use(key, tuple((shape, f32) for shape in activation_shapes(n_cols, k, product.kind)))
    yb = pool.use(object(), (((n_cols, activation_bytes_width(k, lane_sums(product.fmt))), np.int8),))
    runs, prepare = _checked_runs(node, runs_t, n_cols, shared) if runs_t is not None else (whole(n_cols), None)

    def calls() -> list[RowCall]:
        (yq, yd, ys), (y_bytes,), result = acts(), yb(), out()
        quantize = [quantize_call(x, product.kind, yq, yd, ys, threads=n_cols > SERIAL_ROWS)] if quantizes else []
        return [*quantize, *product_calls(product.fmt, product.w, yq, yd, ys, y_bytes, result, runs),
                *(then(result) if then is not None else [])]
    return TableStep(calls, prepare, reads=(runs_t,) if runs_t is not None else (), hold=(pool, x, product, hold))


def column_runs(node: Tensor, t: Tensor, n_cols: int) -> Callable[[], np.ndarray]:
    """MUL_MAT's / MUL_MAT_ID's runs (ops.mul_mat) as int64, checked at every step: they are data
    (over RPC, from the network) - from 0 to the number of columns, never decreasing."""
    view = tensor_view(t).reshape(-1)

    def runs() -> np.ndarray:
        r = view.astype(np.int64)
        if r[0] != 0 or r[-1] != n_cols or (np.diff(r) < 0).any():
            raise ValueError(f"{node.op.name}: runs {r[:8].tolist()}{'...' if r.size > 8 else ''} must rise from 0 "
                             f"to {n_cols} (the columns)")
        return r
    return runs


def bind_mul_mat(node: Tensor, shared: dict) -> Step:
    a, b = node.src[0], node.src[1]
    out = tensor_view(node)  # [b3, b2, N, M]
    x = reader(b)            # [b3, b2, N, K]
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    runs = column_runs(node, node.src[2], b.ne[1]) if len(node.src) > 2 and node.src[2] is not None else None
    if quant_supported(a.type):  # quantized and F16 weights: decoded row by row
        w = tensor_rows(a)   # [a3, a2, M, row_bytes]
        if a.ne[2] == 1 and a.ne[3] == 1 and w[0, 0].flags.c_contiguous:
            product = QuantProduct(w[0, 0], a.type)
            if out.flags.c_contiguous:
                out_rows = out.reshape(-1, a.ne[1])
                table_step = quant_table_step(shared, product, node, b, node.src[2] if runs is not None else None,
                                              lambda: out_rows)
                if table_step is not None:
                    return table_step
            acts = _shared_activations(shared, b, product, x)
            if out.flags.c_contiguous:
                flat = out.reshape(-1, a.ne[1])
                call = product.bound(flat) or (lambda acts, runs=None: product(acts, flat, runs))
                if runs is not None:
                    return lambda: call(acts(), runs())
                return lambda: call(acts())

            def step_copy() -> None:
                res = np.empty((out.size // a.ne[1], a.ne[1]), dtype=f32)
                product(acts(), res, runs() if runs is not None else None)
                out[...] = res.reshape(out.shape)
            return step_copy
        slices = {(i3, i2): w[i3 // r3, i2 // r2] for i3 in range(b.ne[3]) for i2 in range(b.ne[2])}
        # a matrix whose rows lie apart is gathered at every step: a copy made now would go stale
        products = {key: QuantProduct(rows, a.type) for key, rows in slices.items() if rows.flags.c_contiguous}

        def step_batched() -> None:
            xv = x()
            for (i3, i2), rows in slices.items():
                product = products.get((i3, i2)) or QuantProduct(np.ascontiguousarray(rows), a.type)
                res = np.empty(out.shape[2:], dtype=f32)
                product(product.activations(xv[i3, i2]), res, runs() if runs is not None else None)
                out[i3, i2] = res
        return step_batched
    wa = reader(a)            # [a3, a2, M, K]
    if runs is not None:  # (b is 2-D) each run its own product: BLAS's kernels depend on the columns too
        def step_runs() -> None:
            xv, av, r = x()[0, 0], wa()[0, 0], runs()
            for r0, r1 in zip(r[:-1], r[1:]):
                out[0, 0, r0:r1] = np.matmul(xv[r0:r1], av.T)
        return step_runs

    def step_float() -> None:
        xv, av = x(), wa()
        a3, a2, m, k = av.shape
        xs = xv.reshape(a3, r3, a2, r2, xv.shape[2], k)
        res = np.matmul(xs, av.reshape(a3, 1, a2, 1, m, k).swapaxes(-1, -2))
        out[...] = res.reshape(out.shape)
    return step_float


def _cells_by_cell(t: Tensor) -> tuple[Callable[[], list[np.ndarray]], list[np.ndarray] | None]:
    """Per ne3 slice, the K or V cache's cells as nn.attention_cells reads them ([cells,
    n_head_kv * d]: F16 bits, or float32 values): views of the cache made now where its heads lie
    side by side in each cell (also returned), else made from its values at every step (None)."""
    if t.type in (Type.F16, Type.F32):
        view = tensor_view(t)
        view = view.view(np.uint16) if t.type == Type.F16 else view
        cells = [nn.by_cell(view[i3]) for i3 in range(t.ne[3])]
        if all(np.may_share_memory(c, view) for c in cells):
            return (lambda: cells), cells
        return (lambda: [nn.by_cell(view[i3]) for i3 in range(t.ne[3])]), None
    values = reader(t)
    return (lambda: [nn.by_cell(x) for x in values()]), None


class _MaskCells:
    """A step's mask as the attention calls of a plan's table read it, for every layer: its
    rows cut to the cells some row sees and the row cells (nn.row_cells), laid out for that
    many cells in arrays made for all of them; and each call's sizes, whose cell count follows."""

    def __init__(self, mask: Tensor, n_tokens: int) -> None:
        self.view, self.n_tokens, width = tensor_view(mask), n_tokens, mask.ne[0]
        self.mask = np.zeros((n_tokens, width), dtype=f32)
        self.alone = np.zeros(n_tokens, dtype=np.bool_)
        self.n_seen = np.zeros(n_tokens, dtype=np.int64)
        self.cells = np.zeros((n_tokens, width), dtype=np.int32)
        self.sizes: list[np.ndarray] = []

    def prepare(self) -> None:
        m = self.view[0, 0, :self.n_tokens]
        seen = nn.seen_cells(m)
        cut = self.mask.reshape(-1)[:self.n_tokens * seen].reshape(self.n_tokens, seen)
        cut[...] = m[:, :seen]
        alone, n_seen, cells = nn.row_cells(cut)
        self.alone[...], self.n_seen[...] = alone, n_seen
        self.cells.reshape(-1)[:cells.size] = cells.reshape(-1)
        for sizes in self.sizes:
            sizes[nn.SIZES_CELLS] = seen


def _attention_table_step(node: Tensor, shared: dict, scratch: np.ndarray, keys: list[np.ndarray] | None,
                          values: list[np.ndarray] | None) -> TableStep | None:
    """FLASH_ATTN_EXT as a table's call, where its arrays stay where they are from step to step
    (a decoding step's: one sequence's token, the cache read in place, the mask an input); None
    elsewhere."""
    q, k, v, mask = node.src[:4]
    if (keys is None or values is None or mask is None
            or mask.type != Type.F32 or q.type != Type.F32 or q.ne[3] != 1):
        return None
    qv, out = tensor_view(q)[0], tensor_view(node)[0]
    if not (qv.flags.c_contiguous and out.flags.c_contiguous and mask.ne[1] >= q.ne[1]):
        return None
    p = FlashAttnParams.of(node)
    key = ("attention mask table", id(mask), q.ne[1])
    first = key not in shared
    cut = shared[key] = shared.get(key) or _MaskCells(mask, q.ne[1])
    sinks = _sinks(node)
    call, sizes = nn.attention_call(qv, keys[0], values[0], k.ne[2], cut.mask, cut.alone, cut.n_seen, cut.cells,
                                    scratch, f32(p.scale), f32(p.logit_softcap), out, sinks)
    cut.sizes.append(sizes)
    return TableStep(lambda: [call], cut.prepare if first else None, reads=(mask,),
                     hold=(sizes, cut, scratch, qv, out, keys, values, sinks))  # (the call has their addresses only)


def _sinks(node: Tensor) -> np.ndarray | None:
    """FLASH_ATTN_EXT's attention sinks (its fifth source, F32 [n_head]) as they lie, or None."""
    sinks = node.src[4] if len(node.src) > 4 else None
    return tensor_view(sinks).reshape(-1) if sinks is not None else None


def bind_flash_attn_ext(node: Tensor, shared: dict) -> Step:
    """Attention with the rounding of llama.cpp's unfused path over an F16 cache (KQ =
    mul_mat(K, Q), softmax, mul_mat(V, KQ)), as nn.attention_cells computes it, reading the
    cache where it lies."""
    q, k, v, mask = node.src[:4]
    p = FlashAttnParams.of(node)
    scale, softcap = f32(p.scale), f32(p.logit_softcap)
    n_tokens, n_kv, n_head_kv = q.ne[1], k.ne[1], k.ne[2]
    out = tensor_view(node)      # [ne3, n_tokens, n_head, dv]
    (keys, fixed_keys), (values, fixed_values) = _cells_by_cell(k), _cells_by_cell(v)
    qv = reader(q)
    direct = out.flags.c_contiguous
    # the rows' working arrays (a slot per chunk of rows), kept from step to step; the steps of
    # a plan run one after another: its layers share them
    n_rows, d, dv = q.ne[2] * n_tokens, q.ne[0], v.ne[0]
    key = ("attention scratch", n_rows, n_kv, d, dv)
    scratch = shared.get(key)
    if scratch is None:
        scratch = shared[key] = nn.attention_scratch(n_rows, n_kv, d, dv)
    table_step = _attention_table_step(node, shared, scratch, fixed_keys, fixed_values)
    if table_step is not None:
        return table_step
    if mask is not None:
        masked = reader(mask)

        def cut_mask() -> tuple:  # the cells some row sees, and each row's, once per step for every layer
            m = masked()[0, 0, :n_tokens]
            m = np.ascontiguousarray(m[:, :nn.seen_cells(m)])
            return m, nn.row_cells(m)
        mask_rows = _shared_value(shared, ("attention mask", id(mask), n_tokens), cut_mask)
    else:
        no_mask = np.zeros((n_tokens, n_kv), dtype=f32)
        no_mask_cells = (no_mask, nn.row_cells(no_mask))
        mask_rows = lambda: no_mask_cells  # noqa: E731

    sinks = _sinks(node)

    def step() -> None:
        m, seen = mask_rows()
        qa, ka, va = qv(), keys(), values()
        for i3 in range(q.ne[3]):
            res = out[i3] if direct else np.empty(out.shape[1:], dtype=f32)
            nn.attention_cells(np.ascontiguousarray(qa[i3]), ka[i3], va[i3], n_head_kv, m, scale, softcap, res, seen,
                               scratch, sinks)
            if not direct:
                out[i3] = res
    return step


def _row_ids(t: Tensor, n_rows: int, what: str, shared: dict) -> Callable[[], np.ndarray]:
    """For a step that runs in Python: the row ids in t as int64, checked at every step to lie in
    [0, n_rows) - by the first step of the plan that reads t (_checked_ids), whose array the
    others read (a decode step's cache writes: two SET_ROWS per layer, all at the step's cells)."""
    ids, prepare = _checked_ids(t, n_rows, what, shared)
    if prepare is None:
        return lambda: ids

    def checked() -> np.ndarray:
        prepare()
        return ids
    return checked


def _checked_ids(t: Tensor, n_rows: int, what: str, shared: dict) -> tuple[np.ndarray, Callable[[], None] | None]:
    """The row ids in t as int64, in an array of the plan's that table calls read, and what
    fills and checks it before they run: the first step of the plan that reads t gets it (the
    others None)."""
    key = ("checked row ids", id(t), n_rows)
    if key in shared:
        return shared[key], None
    view = tensor_view(t)
    ids = shared[key] = np.empty(view.shape, dtype=np.int64)

    def prepare() -> None:
        ids[...] = view
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            raise IndexError(f"{what}: index out of range [0, {n_rows}) in {t.name or 'indices'}")
    return ids, prepare


def bind_get_rows(node: Tensor, shared: dict) -> Step:
    a, idx = node.src[0], node.src[1]
    out_rows = _row_view(node)
    if (quant_supported(a.type) and a.type.is_quantized and a.ne[2] == a.ne[3] == 1 and idx.ne[1] == idx.ne[2] == 1
            and out_rows is not None and tensor_rows(a)[0, 0].flags.c_contiguous):
        # an embedding's rows for a step's tokens, as a table's call (the ids checked before it runs)
        w, (ids, prepare) = tensor_rows(a)[0, 0], _checked_ids(idx, a.ne[1], "GET_ROWS", shared)
        return TableStep(lambda: [decode_rows_call(DECODER[a.type], w, out_rows, F16_TABLE, ids[0, 0, 0])], prepare,
                         reads=(idx,))
    index = _row_ids(idx, a.ne[1], "GET_ROWS", shared)  # [1, i2, i1, n]
    out = tensor_view(node)    # [i2, i1, n, ne0]
    src = (lambda rows=tensor_rows(a): rows) if a.type.is_quantized else reader(a)
    decode = (lambda picked: dequantize_rows(picked, a.type, a.ne[0])) if quant_supported(a.type) \
        else (lambda picked: quants.dequantize(picked, a.type))

    def step() -> None:
        ids = index()
        rows = src()
        for i2 in range(idx.ne[2]):
            for i1 in range(idx.ne[1]):
                picked = rows[i2, i1][ids[0, i2, i1]]
                out[i2, i1] = decode(np.ascontiguousarray(picked)) if a.type.is_quantized else picked
    return step


def bind_set_rows(node: Tensor, shared: dict) -> Step:
    src, idx, dst = node.src[0], node.src[1], node.src[2]
    r2, r3 = src.ne[2] // idx.ne[1], src.ne[3] // idx.ne[2]
    quantized = node.type.is_quantized
    out = tensor_rows(node) if quantized else tensor_view(node)
    # the KV cache's writes (F32 rows into F16 ones, both contiguous): a table's calls, one per
    # matrix, the ids checked before the table runs
    if node.type == Type.F16 and src.type == Type.F32:
        halves, rows_in = out.view(np.uint16), tensor_view(src)
        matrices = [(rows_in[i3, i2], halves[i3, i2], i3 // r3, i2 // r2)
                    for i3 in range(src.ne[3]) for i2 in range(src.ne[2])]
        if all(a.flags.c_contiguous and b.flags.c_contiguous for a, b, _, _ in matrices):
            ids, prepare = _checked_ids(idx, dst.ne[1], "SET_ROWS", shared)  # (int64, each [0, j3, j2] a row)
            return TableStep(lambda: [nn.set_rows_f16_call(rows, ids[0, j3, j2], cache_rows)
                                      for rows, cache_rows, j3, j2 in matrices], prepare, reads=(idx,))
    index = _row_ids(idx, dst.ne[1], "SET_ROWS", shared)  # [1, i2, i1, n]
    x = reader(src)            # [s3, s2, n, ne0]

    def step() -> None:
        ids = index()
        xv = x()
        for i3 in range(src.ne[3]):
            for i2 in range(src.ne[2]):
                rows, at = xv[i3, i2], ids[0, i3 // r3, i2 // r2]
                out[i3, i2][at] = quants.quantize(rows, node.type) if quantized else rows
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
    x, write = reader(src), writer(node)
    return lambda: write(x())


def bind_concat(node: Tensor, shared: dict) -> Step:
    axis = 3 - ConcatParams.of(node).dim
    a, b, out = reader(node.src[0]), reader(node.src[1]), tensor_view(node)
    return lambda: out.__setitem__(Ellipsis, np.concatenate([a(), b()], axis=axis))


def bind_sum_rows(node: Tensor, shared: dict) -> Step:
    """Rows summed in double, then rounded (ggml_vec_sum_f32 accumulates in ggml_float)."""
    x, out = reader(node.src[0]), tensor_view(node)
    return lambda: out.__setitem__(Ellipsis, x().sum(axis=-1, keepdims=True, dtype=np.float64).astype(f32))


def bind_clamp(node: Tensor, shared: dict) -> Step:
    p = ClampParams.of(node)
    x, out, lo, hi = reader(node.src[0]), tensor_view(node), f32(p.min), f32(p.max)
    return lambda: np.clip(x(), lo, hi, out=out)


def bind_mul_mat_id(node: Tensor, shared: dict) -> Step:
    """Tokens grouped by expert: each expert's rows are read once per batch, for all the
    tokens routed to it (as ggml groups them); with the exact block products, every expert's
    product in one parallel call.  With runs of tokens, a group is an expert's tokens of one
    run (each computed as that run alone would have it)."""
    a, b, ids = node.src[:3]
    runs = column_runs(node, node.src[3], b.ne[2]) if len(node.src) > 3 and node.src[3] is not None else None
    index = tensor_view(ids)[0, 0]           # [n_tokens, n_used]
    x = reader(b)                            # [1, n_tokens, n_b, K]
    out = tensor_view(node)[0]               # [n_tokens, n_used, M]
    n_expert, n_b, m_rows = a.ne[2], b.ne[1], a.ne[1]
    rows = tensor_rows(a)[0] if quant_supported(a.type) else None  # [n_expert, M, row_bytes]
    experts = reader(a) if rows is None else None
    together = QuantProduct(rows[0], a.type) if rows is not None and rows.flags.c_contiguous else None
    if together is not None and not together.exact:
        together = None
    weights = frozen(rows) if together is not None else None

    def step() -> None:
        idx = index.astype(np.int64)
        bad = idx[(idx < 0) | (idx >= n_expert)]
        if bad.size:
            raise ValueError(f"MUL_MAT_ID: expert id {int(bad[0])} outside 0..{n_expert - 1}")
        xv = x()[0]
        # a group: the routed (token, slot) pairs of one expert (and one run of tokens), in token order
        run_of = np.zeros(idx.shape, np.int64) if runs is None else \
            np.broadcast_to((np.searchsorted(runs(), np.arange(idx.shape[0]), side="right") - 1)[:, None], idx.shape)
        key = (idx * (run_of.max() + 1) + run_of).reshape(-1)
        if together is not None:
            order = np.argsort(key, kind="stable")
            t_sel, u_sel = np.divmod(order, idx.shape[1])
            _, first, counts = np.unique(key[order], return_index=True, return_counts=True)
            starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            yq, yd, ys = together.activations(xv[t_sel, u_sel % n_b])
            res = np.empty((order.size, m_rows), dtype=f32)
            used = idx.reshape(-1)[order][first]  # each group's expert
            exact_quant_matmul_id(together.fmt, weights, yq, yd, ys, used.astype(np.int64), starts, res)
            out[t_sel, u_sel] = res
            return
        for group in np.unique(key):
            t_sel, u_sel = np.nonzero(key.reshape(idx.shape) == group)
            e = idx[t_sel[0], u_sel[0]]
            cols = np.ascontiguousarray(xv[t_sel, u_sel % n_b])
            if rows is not None:
                product = QuantProduct(np.ascontiguousarray(rows[e]), a.type)
                res = np.empty((len(cols), m_rows), dtype=f32)
                product(product.activations(cols), res)
            else:
                res = cols @ experts()[0, e].T
            out[t_sel, u_sel] = res
    return step


# up to this k a pass keeping the k best ranked (nn.top_k_rows) beats a partition and a sort
HEAP_TOP_K = 256


def top_k_indices(row: np.ndarray, k: int) -> np.ndarray:
    """pyggml.ranking.top_k_indices (the one order of TOP_K), with a heap for few of many."""
    n = row.size
    k = min(k, n)
    if 0 < k <= HEAP_TOP_K:
        out = np.empty((1, k), dtype=np.int64)
        nn.top_k_rows(np.ascontiguousarray(row, dtype=f32).reshape(1, n), k, out)
        return out[0]
    return ranking.top_k_indices(row, k)


def bind_argsort(node: Tensor, shared: dict) -> Step:
    x, out = reader(node.src[0]), tensor_view(node)
    descending = ArgsortParams.of(node).order == SortOrder.DESC

    def step() -> None:
        v = x()
        out[...] = np.argsort(-v if descending else v, axis=-1, kind="stable").astype(np.int32)
    return step


def bind_top_k(node: Tensor, shared: dict) -> Step:
    x, out, k = reader(node.src[0]), tensor_view(node), node.ne[0]
    n = node.src[0].ne[0]

    def step() -> None:
        v = x()
        if 0 < k <= min(n, HEAP_TOP_K):
            ids = np.empty((v.size // n, k), dtype=np.int64)
            nn.top_k_rows(np.ascontiguousarray(v).reshape(-1, n), k, ids)
            out[...] = ids.reshape(out.shape)
            return
        for idx in np.ndindex(*v.shape[:-1]):
            out[idx] = top_k_indices(v[idx], k)
    return step


def bind_argmax(node: Tensor, shared: dict) -> Step:
    x, out = reader(node.src[0]), tensor_view(node)
    return lambda: out.__setitem__(Ellipsis, x()[0, 0].argmax(axis=-1).astype(np.int32).reshape(1, 1, 1, -1))


OP_TABLE: dict[Op, Binder] = {
    Op.ADD: _binary(np.add, nn.ADD),
    Op.ADD_ID: bind_add_id,
    Op.SUB: _binary(np.subtract, nn.SUB),
    Op.MUL: _binary(np.multiply, nn.MUL),
    Op.DIV: _binary(np.divide, nn.DIV),
    Op.SCALE: bind_scale,
    Op.UNARY: bind_unary,
    Op.GLU: bind_glu,
    Op.RMS_NORM: bind_rms_norm,
    Op.NORM: bind_norm,
    Op.SOFT_MAX: bind_soft_max,
    Op.ROPE: bind_rope,
    Op.MUL_MAT: bind_mul_mat,
    Op.GET_ROWS: bind_get_rows,
    Op.SET_ROWS: bind_set_rows,
    Op.CPY: bind_cpy,
    Op.CONT: bind_cpy,
    Op.DUP: bind_cpy,
    Op.CONCAT: bind_concat,
    Op.ARGMAX: bind_argmax,
    Op.ARGSORT: bind_argsort,
    Op.SUM_ROWS: bind_sum_rows,
    Op.CLAMP: bind_clamp,
    Op.MUL_MAT_ID: bind_mul_mat_id,
    Op.TOP_K: bind_top_k,
    Op.FLASH_ATTN_EXT: bind_flash_attn_ext,
}

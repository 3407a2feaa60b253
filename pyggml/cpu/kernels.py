"""The CPU backend's op table: one numpy (or numba) function per op.

Each kernel receives the node to compute; its sources and its own storage are read and
written in place through numpy views of the buffers (``tensor_view``), in float32.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .. import quants
from ..opdefs import (ArgsortParams, ClampParams, ConcatParams, FlashAttnParams, GluOp, GluParams, NormParams, Op, RopeMode,
                      RopeParams, ScaleParams, SoftMaxParams, SortOrder, UnaryOp, UnaryParams)
from ..tensor import Tensor
from ..types import Type
from . import nn
from .buffer import tensor_rows, tensor_view
from .qdecode import F16_TABLE, f16_values
from .qmatmul import dequantize_rows, quant_matmul
from .qmatmul import supports as quant_supported

f32 = np.float32
Kernel = Callable[[Tensor], None]


def _f16_floats(view: np.ndarray) -> np.ndarray:
    """float32 values of a 4-d float16 view (any strides), through the half table."""
    out = np.empty(view.shape, dtype=f32)
    f16_values(view.view(np.uint16), F16_TABLE, out)
    return out


def values(t: Tensor) -> np.ndarray:
    """A tensor's values as float32 [ne3, ne2, ne1, ne0] (a view when it already is F32)."""
    if t.type == Type.F32:
        return tensor_view(t)
    if t.type == Type.F16:
        return _f16_floats(tensor_view(t))
    if t.type.np_dtype is not None and t.type != Type.BF16:
        return tensor_view(t).astype(f32)
    rows = tensor_rows(t)
    return quants.dequantize(rows.reshape(-1, rows.shape[-1]), t.type).reshape(t.ne[::-1])


def store(dst: Tensor, x: np.ndarray) -> None:
    """Write float values into dst, converting to dst's type (quantizing row by row)."""
    if dst.type.np_dtype is not None and dst.type != Type.BF16:
        tensor_view(dst)[...] = x.reshape(dst.ne[::-1])
    else:
        q = quants.quantize(np.ascontiguousarray(x, dtype=f32).reshape(dst.ne[::-1]), dst.type)
        tensor_rows(dst)[...] = q


def _tile(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml's broadcasting: b repeats to fill shape (each of b's dims divides shape's)."""
    if b.shape == shape or all(x in (1, y) for x, y in zip(b.shape, shape)):
        return b
    return np.tile(b, tuple(y // x for x, y in zip(b.shape, shape)))


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Kernel:
    def kernel(node: Tensor) -> None:
        a, b = node.src[0], node.src[1]
        out = tensor_view(node)
        fn(values(a), _tile(values(b), out.shape), out=out)
    return kernel


def k_scale(node: Tensor) -> None:
    p = ScaleParams.of(node)
    out = tensor_view(node)
    np.multiply(values(node.src[0]), f32(p.scale), out=out)
    if p.bias:
        out += f32(p.bias)


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    from math import erf
    return (f32(0.5) * x * (f32(1) + np.vectorize(erf, otypes=[np.float64])(x / math.sqrt(2)))).astype(f32)


def _hardsigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(f32(1), np.maximum(f32(0), (x + f32(3)) / f32(6)))


def _rows(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=f32).reshape(-1, x.shape[-1])


def _by_rows(kernel: Callable, *inputs: np.ndarray, params: tuple = ()) -> np.ndarray:
    """A numba row kernel of nn.py (``kernel(*rows, *params, out)``) over arrays of any shape."""
    out = np.empty(inputs[0].shape, dtype=f32)
    kernel(*(_rows(x) for x in inputs), *params, out.reshape(-1, inputs[0].shape[-1]))
    return out


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
    UnaryOp.GELU_ERF: _gelu_erf,
    UnaryOp.SGN: np.sign,
    UnaryOp.STEP: lambda x: (x > f32(0)).astype(f32),
    UnaryOp.ELU: lambda x: np.where(x > f32(0), x, np.expm1(x)),
    UnaryOp.HARDSIGMOID: lambda x: _hardsigmoid(x),
    UnaryOp.HARDSWISH: lambda x: x * _hardsigmoid(x),
}

GLU: dict[int, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    GluOp.REGLU: lambda a, b: np.maximum(a, f32(0)) * b,
    GluOp.SWIGLU: lambda a, b: _by_rows(nn.swiglu, a, b),  # the activation and the product in one pass
    GluOp.GEGLU: lambda a, b: _by_rows(nn.geglu, a, b),
}


def k_unary(node: Tensor) -> None:
    tensor_view(node)[...] = UNARY[UnaryParams.of(node).op](values(node.src[0]))


def k_glu(node: Tensor) -> None:
    a = values(node.src[0])
    if node.src[1] is None:
        half = a.shape[-1] // 2
        a, b = a[..., :half], a[..., half:]
    else:
        b = values(node.src[1])
    p = GluParams.of(node)
    if p.swapped:
        a, b = b, a
    tensor_view(node)[...] = GLU[p.op](a, b)


def k_rms_norm(node: Tensor) -> None:
    tensor_view(node)[...] = _by_rows(nn.rms_norm, values(node.src[0]), params=(NormParams.of(node).eps,))


def k_norm(node: Tensor) -> None:
    x = values(node.src[0]).astype(np.float64)
    eps = NormParams.of(node).eps
    centered = x - x.mean(axis=-1, keepdims=True)
    tensor_view(node)[...] = centered / np.sqrt(np.mean(centered * centered, axis=-1, keepdims=True) + eps)


def k_soft_max(node: Tensor) -> None:
    a, mask = node.src[0], node.src[1]
    x = values(a) * f32(SoftMaxParams.of(node).scale)
    if mask is not None:
        m = values(mask)[:, :, :a.ne[1], :]
        x += _tile(m, x.shape)
    rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    nn.softmax_rows(rows)
    tensor_view(node)[...] = rows.reshape(x.shape)


def k_rope(node: Tensor) -> None:
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    p = RopeParams.of(node)
    factors = tensor_view(ff).reshape(-1) if ff is not None else np.ones(1, dtype=f32)
    cos, sin = nn.rope_cache(tensor_view(pos).reshape(-1).astype(np.int64), p.n_dims, p.freq_base, p.freq_scale,
                             p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow, p.n_ctx_orig, factors,
                             ff is not None)
    x = np.ascontiguousarray(values(a))  # [ne3, n_tokens, n_head, head_dim]
    res = np.empty(x.shape, dtype=f32)
    nn.rope_rotate(x, res, cos, sin, p.n_dims, p.mode == RopeMode.NEOX)
    tensor_view(node)[...] = res


def k_mul_mat(node: Tensor) -> None:
    a, b = node.src[0], node.src[1]
    out = tensor_view(node)  # [b3, b2, N, M]
    x = values(b)            # [b3, b2, N, K]
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    if quant_supported(a.type):  # quantized and F16 weights: decoded row by row
        w = tensor_rows(a)   # [a3, a2, M, row_bytes]
        if a.ne[2] == 1 and a.ne[3] == 1 and w[0, 0].flags.c_contiguous:
            out[...] = quant_matmul(w[0, 0], a.type, x.reshape(-1, x.shape[-1])).reshape(out.shape)
            return
        for i3 in range(b.ne[3]):
            for i2 in range(b.ne[2]):
                wi = np.ascontiguousarray(w[i3 // r3, i2 // r2])
                out[i3, i2] = quant_matmul(wi, a.type, x[i3, i2])
        return
    wa = values(a)            # [a3, a2, M, K]
    a3, a2, m, k = wa.shape
    n = x.shape[2]
    xs = x.reshape(a3, r3, a2, r2, n, k)
    res = np.matmul(xs, wa.reshape(a3, 1, a2, 1, m, k).swapaxes(-1, -2))
    out[...] = res.reshape(out.shape)


def _cells(t: Tensor, n: int) -> np.ndarray:
    """The first n cells (ne1) of a K or V cache view as float32 [ne3, ne2, n, ne0]."""
    if t.type != Type.F16:
        return values(t)[:, :, :n]
    return _f16_floats(tensor_view(t)[:, :, :n])


def k_flash_attn_ext(node: Tensor) -> None:
    """Attention with the rounding of llama.cpp's unfused path over an F16 cache (KQ =
    mul_mat(K, Q), softmax, mul_mat(V, KQ)), as nn.attention computes it."""
    q, k, v, mask = node.src[:4]
    p = FlashAttnParams.of(node)
    scale, softcap = p.scale, p.logit_softcap
    n_tokens = q.ne[1]
    out = tensor_view(node)      # [ne3, n_tokens, n_head, dv]
    n_cells = k.ne[1]
    if mask is not None:
        m = values(mask)[0, 0, :n_tokens, :n_cells]
        # nn.attention skips the cells no query sees (probability 0): leave those past the last
        # seen one out of the F16 conversion too; whole 64s keep every sum's lanes as they were
        seen = np.flatnonzero(np.isfinite(m).any(axis=0))
        n_cells = min(n_cells, (int(seen[-1]) // 64 + 1) * 64) if seen.size else n_cells
        m = np.ascontiguousarray(m[:, :n_cells])
    else:
        m = np.zeros((n_tokens, n_cells), dtype=f32)
    qv, kv, vv = values(q), _cells(k, n_cells), _cells(v, n_cells)
    for i3 in range(q.ne[3]):
        res = np.empty(out.shape[1:], dtype=f32)
        nn.attention(np.ascontiguousarray(qv[i3]), np.ascontiguousarray(kv[i3]), np.ascontiguousarray(vv[i3]),
                     m, scale, softcap, res)
        out[i3] = res


def _index_array(t: Tensor) -> np.ndarray:
    return tensor_view(t).astype(np.int64)


def k_get_rows(node: Tensor) -> None:
    a, idx = node.src[0], node.src[1]
    ids = _index_array(idx)  # [1, i2, i1, n]
    if np.any(ids < 0) or np.any(ids >= a.ne[1]):
        raise IndexError(f"GET_ROWS: index out of range [0, {a.ne[1]}) in {idx.name or 'indices'}")
    out = tensor_view(node)  # [i2, i1, n, ne0]
    if a.type.is_quantized:
        rows = tensor_rows(a)
        for i2 in range(idx.ne[2]):
            for i1 in range(idx.ne[1]):
                picked = np.ascontiguousarray(rows[i2, i1][ids[0, i2, i1]])
                out[i2, i1] = dequantize_rows(picked, a.type, a.ne[0]) if quant_supported(a.type) \
                    else quants.dequantize(picked, a.type)
        return
    src = values(a)
    for i2 in range(idx.ne[2]):
        for i1 in range(idx.ne[1]):
            out[i2, i1] = src[i2, i1][ids[0, i2, i1]]


def k_set_rows(node: Tensor) -> None:
    src, idx, dst = node.src[0], node.src[1], node.src[2]
    ids = _index_array(idx)  # [1, i2, i1, n]
    if np.any(ids < 0) or np.any(ids >= dst.ne[1]):
        raise IndexError(f"SET_ROWS: index out of range [0, {dst.ne[1]})")
    x = values(src)          # [s3, s2, n, ne0]
    r2, r3 = src.ne[2] // idx.ne[1], src.ne[3] // idx.ne[2]
    if node.type.is_quantized:
        rows = tensor_rows(node)
        for i3 in range(src.ne[3]):
            for i2 in range(src.ne[2]):
                rows[i3, i2][ids[0, i3 // r3, i2 // r2]] = quants.quantize(x[i3, i2], node.type)
        return
    out = tensor_view(node)
    for i3 in range(src.ne[3]):
        for i2 in range(src.ne[2]):
            out[i3, i2][ids[0, i3 // r3, i2 // r2]] = x[i3, i2]


def k_cpy(node: Tensor) -> None:
    """CPY/CONT/DUP: same values, possibly another type and another layout."""
    src = node.src[0]
    if src.type == node.type and node.type.np_dtype is not None:
        tensor_view(node)[...] = tensor_view(src).reshape(node.ne[::-1]) if src.is_contiguous() \
            else np.ascontiguousarray(tensor_view(src)).reshape(node.ne[::-1])
        return
    store(node, values(src).reshape(node.ne[::-1]))


def k_concat(node: Tensor) -> None:
    dim = ConcatParams.of(node).dim
    tensor_view(node)[...] = np.concatenate([values(node.src[0]), values(node.src[1])], axis=3 - dim)


def k_sum_rows(node: Tensor) -> None:
    """Rows summed in double, then rounded (ggml_vec_sum_f32 accumulates in ggml_float)."""
    tensor_view(node)[...] = values(node.src[0]).sum(axis=-1, keepdims=True, dtype=np.float64).astype(f32)


def k_clamp(node: Tensor) -> None:
    p = ClampParams.of(node)
    np.clip(values(node.src[0]), f32(p.min), f32(p.max), out=tensor_view(node))


def k_mul_mat_id(node: Tensor) -> None:
    """Tokens grouped by expert: each expert's rows are read once per batch, for all the
    tokens routed to it (as ggml groups them)."""
    a, b, ids = node.src[:3]
    idx = tensor_view(ids)[0, 0]            # [n_tokens, n_used]
    n_expert = a.ne[2]
    bad = idx[(idx < 0) | (idx >= n_expert)]
    if bad.size:
        raise ValueError(f"MUL_MAT_ID: expert id {int(bad[0])} outside 0..{n_expert - 1}")
    x = values(b)[0]                         # [n_tokens, n_b, K]
    out = tensor_view(node)[0]               # [n_tokens, n_used, M]
    n_b = x.shape[1]
    rows = tensor_rows(a) if quant_supported(a.type) else None
    for e in np.unique(idx):
        t_sel, u_sel = np.nonzero(idx == e)
        cols = np.ascontiguousarray(x[t_sel, u_sel % n_b])
        if rows is not None:
            w = rows[0, e]
            res = quant_matmul(w if w.flags.c_contiguous else np.ascontiguousarray(w), a.type, cols)
        else:
            res = cols @ values(a)[0, e].T
        out[t_sel, u_sel] = res


def top_k_indices(row: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest values of a 1-D row, largest first, equal values lowest
    index first - one rule, so that TOP_K on any device and the sampler over a whole row
    pick the same k in the same order.  O(n): a partition, then a sort of k."""
    n = row.size
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k < n:
        kth = row[np.argpartition(-row, k - 1)[k - 1]]  # the k-th largest value
        above = np.flatnonzero(row > kth)
        ids = np.concatenate([above, np.flatnonzero(row == kth)[:k - above.size]])
    else:
        ids = np.arange(n)
    return ids[np.lexsort((ids, -row[ids]))]


def k_argsort(node: Tensor) -> None:
    x = values(node.src[0])
    order = ArgsortParams.of(node).order
    tensor_view(node)[...] = np.argsort(-x if order == SortOrder.DESC else x, axis=-1, kind="stable").astype(np.int32)


def k_top_k(node: Tensor) -> None:
    x = values(node.src[0])
    out = tensor_view(node)
    k = node.ne[0]
    for idx in np.ndindex(*x.shape[:-1]):
        out[idx] = top_k_indices(x[idx], k)


def k_argmax(node: Tensor) -> None:
    tensor_view(node)[...] = values(node.src[0])[0, 0].argmax(axis=-1).astype(np.int32).reshape(1, 1, 1, -1)


OP_TABLE: dict[Op, Kernel] = {
    Op.ADD: _binary(np.add),
    Op.SUB: _binary(np.subtract),
    Op.MUL: _binary(np.multiply),
    Op.DIV: _binary(np.divide),
    Op.SCALE: k_scale,
    Op.UNARY: k_unary,
    Op.GLU: k_glu,
    Op.RMS_NORM: k_rms_norm,
    Op.NORM: k_norm,
    Op.SOFT_MAX: k_soft_max,
    Op.ROPE: k_rope,
    Op.MUL_MAT: k_mul_mat,
    Op.GET_ROWS: k_get_rows,
    Op.SET_ROWS: k_set_rows,
    Op.CPY: k_cpy,
    Op.CONT: k_cpy,
    Op.DUP: k_cpy,
    Op.CONCAT: k_concat,
    Op.ARGMAX: k_argmax,
    Op.ARGSORT: k_argsort,
    Op.SUM_ROWS: k_sum_rows,
    Op.CLAMP: k_clamp,
    Op.MUL_MAT_ID: k_mul_mat_id,
    Op.TOP_K: k_top_k,
    Op.FLASH_ATTN_EXT: k_flash_attn_ext,
}

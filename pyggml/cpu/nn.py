"""Softmax, RoPE, attention and gated activations with ggml's CPU rounding (numba).

Each kernel does the float operations of ggml-cpu's x86 code in the same order (simd.py), so
that the results equal llama.cpp's bit for bit:

- softmax (``ggml_vec_soft_max_f32``): exp by ggml_v_expf 16 lanes at a time, each 16-lane
  group summed in float the way ``_mm512_reduce_add_ps`` does, the groups in double; the
  row scaled by ``(float)(1/sum)``; a tail of fewer than 16 values uses the C library's expf.
- RoPE (``ggml_rope_cache_init`` + ``rotate_pairs``): the angle advances by a float
  multiplication per pair, cosf/sinf from the C library, the rotation fused as GCC compiles
  ``x0*c - x1*s``.
- attention (llama.cpp's unfused path over an F16 cache, as llamafile's tinyBLAS computes
  it): Q and the probabilities rounded to F16, every dot product accumulated in 16 lanes
  by fused multiply-adds and summed like ``_mm512_reduce_add_ps``.
- RMS norm: squares summed in double, one at a time.
- SiLU/SwiGLU via ggml_v_silu; GELU/GeGLU through ggml's F16 lookup table.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from .parts import GATES, LAYERS, part, sample_x
from .rows import RowCall, address_of, c_rows, chunking, row_args, row_kernel, rows_call, run_calls, serial_call
from .simd import (EXP_RANGE, KERNEL, expf_in_range, expf_v, f16_axpy16, f16_bits, f16_dot16, f16_dot64,
                   fma32, half_to_float, pointer, reduce16, round_f16, silu_v, sum_lanes16, sum_lanes64)

f32 = np.float32
_jit = njit(inline="always", **KERNEL)


@functools.cache
def _kernel(rows) -> int:
    """The address of a row kernel of this file (rows.row_kernel), compiled on first use."""
    return row_kernel(rows)


@_jit
def rows_of(at, n_rows, n):
    """The float32 rows [n_rows, n] at address ``at`` (a row kernel's view of an array)."""
    return carray(pointer(at, np.float32), (n_rows, n))


@_jit
def _hidden16(w, o):
    for i in range(o, o + 16):
        if w[i] != -np.inf:
            return False
    return True


@njit(**KERNEL)
def _softmax_row(w, sink):
    """In place over the row w (already scaled and masked).  A function of its own, not a
    parallel loop's body (numba compiles those slowly) nor inlined (numba would copy its code).
    ``sink`` (-inf: none): an attention sink's logit, in the maximum and the sum, as ggml's
    soft_max counts it (its own exp by the C library's expf)."""
    n = w.shape[0]
    mx = f32(-np.inf)
    for i in range(n):
        mx = max(mx, w[i])
    mx = max(mx, sink)
    total = 0.0
    full = n - n % 16
    for o in range(0, full, 16):
        if mx != -np.inf and _hidden16(w, o):
            # 16 masked cells: each exp is exactly 0, and zeros leave the sum as it is
            for i in range(o, o + 16):  # (a loop: an array expression is a parallel loop to numba)
                w[i] = 0.0
            continue
        for i in range(o, o + 16):  # a masked cell's exp is exactly 0 (unless the whole row is masked)
            w[i] = expf_v(w[i] - mx) if w[i] != -np.inf or mx == -np.inf else f32(0.0)
        total += np.float64(reduce16(w, o))
    for i in range(full, n):
        w[i] = f32(math.exp(w[i] - mx))
        total += np.float64(w[i])
    if sink != -np.inf:
        total += np.float64(f32(math.exp(f32(sink - mx))))
    inv = f32(1.0 / total)
    for i in range(n):
        w[i] *= inv


def _softmax_rows(start, end, x_at, n, i2, i3, i4, i5, i6, i7, i8, i9, f0, f1):
    x = rows_of(x_at, end, n)
    for r in range(start, end):
        _softmax_row(x[r], f32(-np.inf))


SoftmaxArgs = row_args(_softmax_rows)


def softmax_call(x: np.ndarray) -> RowCall:
    """softmax_rows(x) as a call (rows.RowCall)."""
    if not (x.ndim == 2 and c_rows(f32, x)):
        raise ValueError("softmax: the rows must be C-contiguous float32")
    return rows_call(_kernel(_softmax_rows), x.shape[0], SoftmaxArgs(x_at=address_of(x), n=x.shape[1]))


@njit(**KERNEL)
def softmax_rows_sinks(x, sinks):
    """Rows of x [rows, n] in place, row r with the attention sink ``sinks[r]``."""
    for r in range(x.shape[0]):
        _softmax_row(x[r], sinks[r])


def softmax_rows(x: np.ndarray) -> None:
    """Rows of x [rows, n] (scaled and masked, C-contiguous float32) in place."""
    run_calls([softmax_call(x)])


@_jit
def _rms_row(x, r, eps, out):
    n = x.shape[1]
    total = 0.0
    for i in range(n):
        total += np.float64(x[r, i] * x[r, i])
    scale = f32(1.0) / f32(math.sqrt(f32(total / n) + f32(eps)))
    for i in range(n):
        out[r, i] = x[r, i] * scale


def _same_rows(what: str, *arrays: np.ndarray) -> None:
    """That a row kernel may view ``arrays`` as rows of one shape: 2-d, C-contiguous float32."""
    if not (arrays[0].ndim == 2 and c_rows(f32, *arrays) and all(a.shape == arrays[0].shape for a in arrays)):
        raise ValueError(f"{what}: the arrays must be C-contiguous float32 rows of one shape")


def rms_norm_call(x: np.ndarray, eps: float, out: np.ndarray) -> RowCall:
    """rms_norm(x, eps, out) as a call (rows.RowCall)."""
    _same_rows("rms_norm", x, out)
    return rows_call(_kernel(_norm_rows), x.shape[0],  # (neither an add nor a weight)
                     NormArgs(summed_at=address_of(x), normed_at=address_of(out), n=x.shape[1], eps=eps))


def rms_norm(x: np.ndarray, eps: float, out: np.ndarray) -> None:
    """ggml_compute_forward_rms_norm_f32 over the rows of x [rows, n]: squares rounded to float,
    summed in double in order; the mean and the scale in float."""
    run_calls([rms_norm_call(x, eps, out)])


# elementwise_call's operations
ADD, SUB, MUL, DIV, SCALE = range(5)


def _elementwise_rows(start, end, a_at, b_at, out_at, n, b_row_step, op, i6, i7, i8, i9, scale, bias):
    """Rows start..end of out = a (op) b, b's row r * b_row_step (0: one row for all), each value
    rounded as numpy's float32 operation rounds it; SCALE: a * scale, then + bias where bias is
    not 0 (two roundings, as ggml's scale and numpy's two steps)."""
    a, out = rows_of(a_at, end, n), rows_of(out_at, end, n)
    b = carray(pointer(b_at, np.float32), ((end - 1) * b_row_step + n,)) if op != SCALE else a[0]
    s, c = f32(scale), f32(bias)
    for r in range(start, end):
        o = r * b_row_step
        if op == ADD:
            for i in range(n):
                out[r, i] = a[r, i] + b[o + i]
        elif op == SUB:
            for i in range(n):
                out[r, i] = a[r, i] - b[o + i]
        elif op == MUL:
            for i in range(n):
                out[r, i] = a[r, i] * b[o + i]
        elif op == DIV:
            for i in range(n):
                out[r, i] = a[r, i] / b[o + i]
        elif c != f32(0.0):
            for i in range(n):
                out[r, i] = a[r, i] * s + c  # (numba rounds each operation: no fma)
        else:
            for i in range(n):
                out[r, i] = a[r, i] * s


ElementwiseArgs = row_args(_elementwise_rows)


def elementwise_call(op: int, a: np.ndarray, b: np.ndarray | None, out: np.ndarray, scale: float = 0.0,
                     bias: float = 0.0) -> RowCall:
    """out = a (op) b for rows a, out [rows, n] and b of the same shape or a single row [1, n]
    (ADD, SUB, MUL, DIV), or out = a * scale + bias (SCALE, b None), as a call (rows.RowCall)."""
    _same_rows("elementwise", a, out)
    step = 0
    if op != SCALE:
        if b is None or not (b.ndim == 2 and c_rows(f32, b) and b.shape[1] == a.shape[1] and b.shape[0] in (1, a.shape[0])):
            raise ValueError("elementwise: b must be C-contiguous float32 rows of a's shape, or one row")
        step = a.shape[1] if b.shape[0] > 1 else 0
    return rows_call(_kernel(_elementwise_rows), a.shape[0],
                     ElementwiseArgs(a_at=address_of(a), b_at=0 if b is None else address_of(b), out_at=address_of(out),
                                     n=a.shape[1], b_row_step=step, op=op, scale=scale, bias=bias))


def _norm_rows(start, end, a_at, b_at, summed_at, w_at, normed_at, out_at, n, add, mul, i9, eps, f1):
    """Rows start..end of add_rms_norm_mul (``mul``: times the weight; without it, out is normed:
    rms_norm's rows, one kernel for both).  a, b are read with ``add`` only, w and out with
    ``mul`` only."""
    a, b, summed = rows_of(a_at, end, n), rows_of(b_at, end, n), rows_of(summed_at, end, n)
    normed, out, w = rows_of(normed_at, end, n), rows_of(out_at, end, n), rows_of(w_at, 1, n)
    for r in range(start, end):
        if add:
            for i in range(n):
                summed[r, i] = a[r, i] + b[r, i]
        _rms_row(summed, r, eps, normed)
        if mul:
            for i in range(n):
                out[r, i] = normed[r, i] * w[0, i]


NormArgs = row_args(_norm_rows)


def add_rms_norm_mul_call(a: np.ndarray, b: np.ndarray, add: bool, summed: np.ndarray, eps: float, w: np.ndarray,
                          normed: np.ndarray, out: np.ndarray) -> RowCall:
    """add_rms_norm_mul as a call (rows.RowCall): a decoding step's row, in the calling thread."""
    _same_rows("add_rms_norm_mul", a, b, summed, normed, out)
    if not (c_rows(f32, w) and w.size == summed.shape[1]):
        raise ValueError("add_rms_norm_mul: the weight must be a C-contiguous float32 row of the rows' width")
    return serial_call(_kernel(_norm_rows), summed.shape[0],
                       NormArgs(a_at=address_of(a), b_at=address_of(b), summed_at=address_of(summed), w_at=address_of(w),
                                normed_at=address_of(normed), out_at=address_of(out), n=summed.shape[1], add=int(add),
                                mul=1, eps=eps))


def add_rms_norm_mul(a, b, add, summed, eps, w, normed, out) -> None:
    """A layer's residual add, the next norm and its weight, row by row in one pass (a decoding
    step's: each was a call of its own): summed = a + b (with ``add``; else summed is the
    input), normed = rms_norm(summed), out = normed * w [n] - each value rounded as the three
    ops round it, every result written (later ops read summed and may read normed)."""
    run_calls([add_rms_norm_mul_call(a, b, add, summed, eps, w, normed, out)])


@_jit
def _in_exp_range(x, n, shift):
    """Whether every x[i] - shift, i < n, is within EXP_RANGE (NaN is not): a count, not an early
    exit, so that the loop vectorizes."""
    outside = 0
    for i in range(n):
        outside += not abs(x[i] - shift) <= EXP_RANGE
    return outside == 0


@_jit
def _silu_row(a, g, out, r, gated):
    """silu(a[r]) (times g[r] if gated) into out[r]: ggml_v_silu 16 values at a time, the C
    library's expf for the last n % 16 (ggml works row by row too).  Rows within expf's normal
    range (all of them, in practice) take its branch-free steps, which vectorize."""
    n = a.shape[1]
    full = n - n % 16
    in_range = _in_exp_range(a[r], full, f32(0.0))
    if in_range and gated:
        for i in range(full):
            out[r, i] = a[r, i] / (f32(1.0) + expf_in_range(f32(0.0) - a[r, i])) * g[r, i]
    elif in_range:
        for i in range(full):
            out[r, i] = a[r, i] / (f32(1.0) + expf_in_range(f32(0.0) - a[r, i]))
    else:
        for i in range(full):
            out[r, i] = silu_v(a[r, i]) * g[r, i] if gated else silu_v(a[r, i])
    for i in range(full, n):
        v = a[r, i]
        v = v / (f32(1.0) + f32(math.exp(-v)))
        out[r, i] = v * g[r, i] if gated else v


def _silu_rows(start, end, a_at, g_at, out_at, n, gated, table_at, i6, i7, i8, i9, f0, f1):
    a, g, out = rows_of(a_at, end, n), rows_of(g_at, end, n), rows_of(out_at, end, n)
    for r in range(start, end):
        _silu_row(a, g, out, r, gated != 0)


GluArgs = row_args(_silu_rows)  # (and _gelu_rows', the same)


def _glu_call(a: np.ndarray, g: np.ndarray, out: np.ndarray, gated: bool, table: np.ndarray, at: int) -> RowCall:
    """A GLU's rows (its activation's alone, without ``gated``): the row kernel at ``at``
    (SiLU's, or GELU's, which reads ``table``)."""
    _same_rows("gated activation", a, g, out)
    return rows_call(at, a.shape[0], GluArgs(a_at=address_of(a), g_at=address_of(g), out_at=address_of(out),
                                             n=a.shape[1], gated=int(gated), table_at=address_of(table)))


_NO_TABLE = np.zeros(1, dtype=f32)  # SiLU's: it reads no table (GELU's is gelu_table(), 65536 values)


def swiglu_call(a: np.ndarray, g: np.ndarray, out: np.ndarray) -> RowCall:
    return _glu_call(a, g, out, True, _NO_TABLE, _kernel(_silu_rows))


def _swiglu_oai_rows(start, end, a_at, g_at, out_at, n, i4, i5, i6, i7, i8, i9, alpha, limit):
    """gpt-oss's gate (ggml's swiglu_oai), float32 step by step: x = min(a, limit), y = g
    clamped to +-limit, x / (1 + expf(alpha * -x)) * (y + 1), expf correctly rounded (the exp
    in double, then rounded), as glibc's."""
    a, g, out = rows_of(a_at, end, n), rows_of(g_at, end, n), rows_of(out_at, end, n)
    al, lim = f32(alpha), f32(limit)
    for r in range(start, end):
        for i in range(n):
            x = min(a[r, i], lim)
            y = min(max(g[r, i], -lim), lim)
            e = f32(math.exp(np.float64(al * -x)))
            out[r, i] = x / (f32(1.0) + e) * (y + f32(1.0))


SwigluOaiArgs = row_args(_swiglu_oai_rows)


def swiglu_oai_call(a: np.ndarray, g: np.ndarray, out: np.ndarray, alpha: float, limit: float) -> RowCall:
    _same_rows("swiglu_oai", a, g, out)
    return rows_call(_kernel(_swiglu_oai_rows), a.shape[0], SwigluOaiArgs(
        a_at=address_of(a), g_at=address_of(g), out_at=address_of(out), n=a.shape[1], alpha=alpha, limit=limit))


def geglu_call(a: np.ndarray, g: np.ndarray, out: np.ndarray) -> RowCall:
    return _glu_call(a, g, out, True, gelu_table(), _kernel(_gelu_rows))


def silu(x: np.ndarray, out: np.ndarray) -> None:
    """ggml_vec_silu_f32 per row of x [rows, n] (C-contiguous float32, as out)."""
    run_calls([_glu_call(x, x, out, False, _NO_TABLE, _kernel(_silu_rows))])


def swiglu(a: np.ndarray, g: np.ndarray, out: np.ndarray) -> None:
    """ggml_vec_swiglu_f32 per row: silu(a) * g, as ``silu``."""
    run_calls([swiglu_call(a, g, out)])


@functools.cache
def gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16: GELU (tanh form, float32) of every half, rounded to a half
    (built once per process, as ggml does at start-up)."""
    x = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    return _gelu_table(x)


@njit(**KERNEL)
def _gelu_table(x):
    out = np.empty_like(x)
    a, s = f32(0.044715), f32(0.79788456080286535587989211986876)
    for i in range(x.size):
        v = x[i]
        if not math.isfinite(v):
            out[i] = v
            continue
        inner = s * v * fma32(a * v, v, f32(1.0))
        out[i] = round_f16(f32(0.5) * v * (f32(1.0) + f32(math.tanh(inner))))
    return out


@_jit
def _gelu_row(a, g, out, r, table, gated):
    """Row r of _gelu_rows: no branch per value - the table read at F16(x) for every x (any
    float's half bits index one of its 65536 entries), then the bounds chosen over it - so
    that the loop vectorizes (the table read as a gather)."""
    for i in range(a.shape[1]):
        v = a[r, i]
        y = table[f16_bits(v)]
        y = f32(0.0) if v <= f32(-10.0) else y
        y = v if v >= f32(10.0) or v != v else y
        out[r, i] = y * g[r, i] if gated else y


def _gelu_rows(start, end, a_at, g_at, out_at, n, gated, table_at, i6, i7, i8, i9, f0, f1):
    """GGML_GELU_FP16: GELU(x) read from the table at F16(x) (nearest, ties to even); 0 at or
    below -10 and x at or above 10.  A NaN passes neither bound; ggml reads its table at the
    half NaN, whose entry is NaN: ours is x itself, NaN as well."""
    a, g, out = rows_of(a_at, end, n), rows_of(g_at, end, n), rows_of(out_at, end, n)
    table = carray(pointer(table_at, np.float32), (65536,))
    for r in range(start, end):
        _gelu_row(a, g, out, r, table, gated != 0)


def geglu(a: np.ndarray, g: np.ndarray, out: np.ndarray) -> None:
    """ggml_vec_geglu_f32 (rows of a, g and out are contiguous float32)."""
    run_calls([geglu_call(a, g, out)])


def gelu(a: np.ndarray, out: np.ndarray) -> None:
    run_calls([_glu_call(a, a, out, False, gelu_table(), _kernel(_gelu_rows))])


# -- RoPE --------------------------------------------------------------------------------------------

@_jit
def _yarn_corr_dim(n_dims, n_ctx_orig, n_rot, base):
    return f32(n_dims) * f32(math.log(f32(n_ctx_orig) / (f32(n_rot) * f32(2.0) * f32(math.pi)))) \
        / (f32(2.0) * f32(math.log(base)))


def rope_cache(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
               attn_factor: float, beta_fast: float, beta_slow: float, n_ctx_orig: int, freq_factors: np.ndarray,
               has_factors: bool) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin per position (int64 [n_pos]) and pair, [n_pos, n_dims/2] each, as
    ggml_rope_cache_init; freq_factors: float32 [n_dims/2] where has_factors."""
    if has_factors and freq_factors.size < n_dims // 2:
        raise ValueError(f"rope: {freq_factors.size} frequency factors for {n_dims} dimensions")
    cos = np.empty((pos.size, n_dims // 2), dtype=f32)  # (made here: nothing for numba to compile)
    sin = np.empty_like(cos)
    _rope_cache(pos, n_dims, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig,
                freq_factors, has_factors, cos, sin)
    return cos, sin


@njit(**KERNEL)
def _rope_cache(pos, n_dims, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow,
                n_ctx_orig, freq_factors, has_factors, cos, sin):
    half = n_dims // 2
    theta_scale = f32(math.pow(f32(freq_base), f32(-2.0) / f32(n_dims)))
    low = max(f32(0.0), f32(math.floor(_yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, f32(freq_base)))))
    high = min(f32(n_dims - 1), f32(math.ceil(_yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, f32(freq_base)))))
    for t in range(pos.size):
        theta = f32(pos[t])
        for i in range(half):
            ff = freq_factors[i] if has_factors else f32(1.0)
            extrap = theta / ff
            th = f32(freq_scale) * extrap
            mscale = f32(attn_factor)
            if ext_factor != 0.0:
                y = (f32(i) - low) / max(f32(0.001), high - low)
                ramp = (f32(1.0) - min(f32(1.0), max(f32(0.0), y))) * f32(ext_factor)
                th = th * (f32(1.0) - ramp) + extrap * ramp
                mscale *= f32(1.0) + f32(0.1) * f32(math.log(f32(1.0) / f32(freq_scale)))
            cos[t, i] = f32(math.cos(th)) * mscale
            sin[t, i] = f32(math.sin(th)) * mscale
            theta = theta * theta_scale


@_jit
def _rope_row(x, out, cos, sin, n_dims, neox, r, t):
    """Row r [n_head, head_dim] of x and out, at token t (cos and sin's row)."""
    n_head, hd = x.shape[1], x.shape[2]
    half = n_dims // 2
    for h in range(n_head):
        for i in range(half):
            j0, j1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
            x0, x1 = x[r, h, j0], x[r, h, j1]
            c, s = cos[t, i], sin[t, i]
            out[r, h, j0] = fma32(x0, c, -(x1 * s))
            out[r, h, j1] = fma32(x0, s, x1 * c)
        for j in range(n_dims, hd):
            out[r, h, j] = x[r, h, j]


def _rope_rows(start, end, x_at, out_at, cos_at, sin_at, n_tok, n_head, hd, n_dims, neox, i9, f0, f1):
    x = carray(pointer(x_at, np.float32), (end, n_head, hd))
    out = carray(pointer(out_at, np.float32), (end, n_head, hd))
    cos, sin = rows_of(cos_at, n_tok, n_dims // 2), rows_of(sin_at, n_tok, n_dims // 2)
    for r in range(start, end):
        _rope_row(x, out, cos, sin, n_dims, neox != 0, r, r % n_tok)


RopeArgs = row_args(_rope_rows)


def rope_call(x: np.ndarray, out: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_dims: int, neox: bool) -> RowCall:
    """rope_rotate as a call (rows.RowCall)."""
    if not (x.ndim == 4 and c_rows(f32, x, out, cos, sin) and x.shape == out.shape and cos.shape == sin.shape
            and cos.ndim == 2 and cos.shape[0] >= x.shape[1] and cos.shape[1] == n_dims // 2
            and 0 <= n_dims <= x.shape[3]):
        raise ValueError("rope: x, out, cos and sin must be C-contiguous float32 and of agreeing shapes")
    b3, n_tok, n_head, hd = x.shape
    return rows_call(_kernel(_rope_rows), b3 * n_tok,
                     RopeArgs(x_at=address_of(x), out_at=address_of(out), cos_at=address_of(cos), sin_at=address_of(sin),
                              n_tok=n_tok, n_head=n_head, hd=hd, n_dims=n_dims, neox=int(neox)))


def rope_rotate(x: np.ndarray, out: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_dims: int, neox: bool) -> None:
    """x, out [batch, n_tokens, n_head, head_dim]; pairs (2i, 2i+1), or (i, i + n_dims/2) for
    NEOX; dimensions past n_dims are copied."""
    run_calls([rope_call(x, out, cos, sin, n_dims, neox)])


def _set_rows_f16_rows(start, end, x_at, ids_at, out_at, n, n_out, i5, i6, i7, i8, i9, f0, f1):
    """Rows start..end of x into the F16 rows ids[...] of out: set_rows_f16's."""
    x = rows_of(x_at, end, n)
    ids = carray(pointer(ids_at, np.int64), (end,))
    out = carray(pointer(out_at, np.uint16), (n_out, n))
    for i in range(start, end):
        r = ids[i]
        for j in range(n):
            out[r, j] = f16_bits(x[i, j])


SetRowsArgs = row_args(_set_rows_f16_rows)


def set_rows_f16_call(x: np.ndarray, ids: np.ndarray, out: np.ndarray) -> RowCall:
    """set_rows_f16 as a call (rows.RowCall), in the calling thread: a few rows per step.  The
    ids are read when it runs: the caller checks them first, at every run."""
    if not (x.ndim == 2 and out.ndim == 2 and c_rows(f32, x) and c_rows(np.int64, ids) and c_rows(np.uint16, out)
            and ids.shape == (x.shape[0],) and out.shape[1] == x.shape[1]):
        raise ValueError("set_rows_f16: x float32 [n, ne0], ids int64 [n] and out uint16 [rows, ne0], C-contiguous")
    return serial_call(_kernel(_set_rows_f16_rows), x.shape[0],
                       SetRowsArgs(x_at=address_of(x), ids_at=address_of(ids), out_at=address_of(out), n=x.shape[1],
                                   n_out=out.shape[0]))


def set_rows_f16(x: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """out[ids[i]] = x[i] as F16 bits (x float32 [n, ne0], ids int64 [n], out uint16 [rows,
    ne0]): SET_ROWS into an F16 cache, as ggml's FP32 -> FP16 (nearest, ties to even)."""
    if ids.size and (ids.min() < 0 or ids.max() >= out.shape[0]):
        raise IndexError(f"set_rows_f16: a row id outside [0, {out.shape[0]})")
    run_calls([set_rows_f16_call(x, ids, out)])


# -- attention ---------------------------------------------------------------------------------------

def _dot_tinyblas(krow, q16, lanes):
    """llamafile's tinyBLAS F16 dot: one 16-lane accumulator, over whole 16s (the caller takes
    _dot_vec_f16 for other head sizes, as ggml does when tinyBLAS declines them).  ``krow``: one
    cell's key (1-d), F16 bits (simd.f16_dot16) or float32 values; ``lanes``: scratch."""


@overload(_dot_tinyblas, inline="always")
def _dot_tinyblas_impl(krow, q16, lanes):
    if krow.dtype == types.uint16:
        return lambda krow, q16, lanes: f16_dot16(krow, q16, q16.size // 16)

    def dot(krow, q16, lanes):
        for j in range(16):
            lanes[j] = 0.0
        for o in range(0, q16.size, 16):
            for j in range(16):
                lanes[j] = fma32(krow[o + j], q16[o + j], lanes[j])
        return reduce16(lanes, 0)
    return dot


def _dot_vec_f16(krow, q16, lanes):
    """ggml_vec_dot_f16 (AVX-512): four 16-lane accumulators over steps of 64, folded 0+2,
    1+3, then together (simd.f16_dot64 for F16 bits); a tail past the last 64 summed in double."""


@overload(_dot_vec_f16, inline="always")
def _dot_vec_f16_impl(krow, q16, lanes):
    if krow.dtype == types.uint16:
        def dot(krow, q16, lanes):
            n = q16.size
            full = n - n % 64
            total = np.float64(f16_dot64(krow, q16, full // 64))
            for i in range(full, n):
                total += np.float64(half_to_float(krow[i]) * q16[i])
            return f32(total)
        return dot

    def dot_f32(krow, q16, lanes):
        n = q16.size
        full = n - n % 64
        for j in range(64):
            lanes[j] = 0.0
        for o in range(0, full, 64):
            for j in range(64):
                lanes[j] = fma32(krow[o + j], q16[o + j], lanes[j])
        for j in range(16):
            lanes[j] = (lanes[j] + lanes[32 + j]) + (lanes[16 + j] + lanes[48 + j])
        total = np.float64(reduce16(lanes, 0))
        for i in range(full, n):
            total += np.float64(krow[i] * q16[i])
        return f32(total)
    return dot_f32


def _add_scaled(acc, vrow, p):
    """``acc += vrow * p``, one rounding per element (fma): a cell's V row into its lane's sums;
    vrow F16 bits (simd.f16_axpy16 over whole 16s) or float32 values."""


@overload(_add_scaled, inline="always")
def _add_scaled_impl(acc, vrow, p):
    if vrow.dtype == types.uint16:
        def add_f16(acc, vrow, p):
            full = vrow.size - vrow.size % 16
            f16_axpy16(acc, vrow, p, full // 16)
            for j in range(full, vrow.size):
                acc[j] = fma32(half_to_float(vrow[j]), p, acc[j])
        return add_f16

    def add_f32(acc, vrow, p):
        for j in range(vrow.size):
            acc[j] = fma32(vrow[j], p, acc[j])
    return add_f32


@_jit
def _sum_lanes(acc, out, single):
    """out[j] = the lane sums of column j of acc (zeroed lanes: [64, dv]) in ggml's order - 64
    lanes for a single token (ggml_vec_dot_f16), 16 for tinyBLAS - leaving acc zeroed."""
    dv = out.size
    if dv % 16 == 0:
        if single:
            sum_lanes64(acc, out, dv // 16)
        else:
            sum_lanes16(acc, out, dv // 16)
        return
    if single:
        for lane in range(16):
            for j in range(dv):
                acc[lane, j] = (acc[lane, j] + acc[32 + lane, j]) + (acc[16 + lane, j] + acc[48 + lane, j])
    for j in range(dv):
        out[j] = reduce16(acc[:, j], 0)
    for lane in range(64):
        for j in range(dv):
            acc[lane, j] = 0.0


@_jit
def _softmax_seen(w, n, cells, m, sink):
    """``_softmax_row`` of w[:n] whose cells other than cells[:m] (ascending) were -inf and hold
    the 0 their exponential is: the exponentials of the cells seen only, each 16-lane group that
    holds one summed as there (the other groups add 0), the tail past the last whole 16 in order.
    ``sink`` (-inf: none): an attention sink's logit, counted as _softmax_row counts it."""
    # the cells 0..m-1, as a sequence's decoding step sees them: loops over them, not cells[]
    dense = m > 0 and cells[m - 1] == m - 1
    mx = f32(-np.inf)
    for i in range(m):
        mx = max(mx, w[i if dense else cells[i]])
    mx = max(mx, sink)
    full = n - n % 16
    if dense and _in_exp_range(w, min(m, full), mx):
        # every exponent within EXP_RANGE: one loop of the branch-free exponential, which vectorizes
        for c in range(min(m, full)):
            w[c] = expf_in_range(w[c] - mx)
        for c in range(full, m):
            w[c] = f32(math.exp(w[c] - mx))
    else:
        for i in range(m):
            c = cells[i]
            w[c] = expf_v(w[c] - mx) if c < full else f32(math.exp(w[c] - mx))
    total = 0.0
    group = -1
    for i in range(m):
        c = cells[i]
        if c >= full:
            break
        if c // 16 != group:
            group = c // 16
            total += np.float64(reduce16(w, group * 16))
    for c in range(full, n):
        total += np.float64(w[c])
    if sink != -np.inf:
        total += np.float64(f32(math.exp(f32(sink - mx))))
    inv = f32(1.0 / total)
    for i in range(m):
        w[i if dense else cells[i]] *= inv


# called, not inlined, by attention's rows (inlined there, the attention part compiled no sooner)
_softmax_seen_call = njit(**KERNEL)(_softmax_seen.py_func)


def seen_cells(mask: np.ndarray) -> int:
    """How many leading cells attention reads: up to the last one some row of ``mask`` [n_tokens,
    n_kv] shows, in whole 64s (cells past it have probability 0; whole 64s keep every sum's lanes
    as over the whole cache); all of them when no row shows any."""
    n_kv = mask.shape[1]
    shown = np.flatnonzero(np.isfinite(mask).any(axis=0))
    return n_kv if shown.size == 0 else min(n_kv, (int(shown[-1]) // 64 + 1) * 64)


def attention_cells(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head_kv: int, mask: np.ndarray, scale,
                    softcap, out: np.ndarray, seen: tuple | None = None, scratch: np.ndarray | None = None,
                    sinks: np.ndarray | None = None) -> None:
    """q [n_head, n_tokens, d] (F32, rounded to F16 here); k [cells, n_head_kv * d] and v [cells,
    n_head_kv * dv], a cell's heads side by side as the cache holds them: F16 bits (uint16) or
    float32 values; mask [n_tokens, n_kv] (the first n_kv cells are read) -> out [n_tokens,
    n_head, dv].

    ggml computes both products with tinyBLAS when there are several tokens and with
    ggml_vec_dot_f16 for a single one (llama.cpp's decoding step); the two sum in different
    lane orders.  "A single one" is taken per sequence: a row that shares no visible cell
    with another row is the only token of its sequence here and is summed as a single
    token, so a sequence's next token gets the same bits decoded alone or in a batch with
    other sequences' tokens (for one sequence, the choice is ggml's).  The cache is taken as
    padded with zeros to a multiple of 64 cells (llama.cpp pads it to 256).  Cells the mask
    hides are skipped: their probability is exactly 0.

    ``seen``: row_cells(mask), where the caller has it (a step's layers share one mask);
    ``scratch``: attention_scratch()'s for these rows, where the caller keeps one from call to
    call (made here otherwise)."""
    alone, n_seen, cells = row_cells(mask) if seen is None else seen
    if scratch is None:
        scratch = attention_scratch(q.shape[0] * q.shape[1], mask.shape[1], q.shape[2], out.shape[2])
    call, sizes = attention_call(q, k, v, n_head_kv, mask, alone, n_seen, cells, scratch, scale, softcap, out, sinks)
    run_calls([call])  # (sizes and sinks held until it ran)


def row_cells(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What attention_cells derives from a mask [n_tokens, n_kv]: which rows are alone in their
    sequence - share no cell they see with another row (rows of one sequence always share cells,
    those of others never do) -, how many cells each row sees, and which, in ascending order.
    (numpy, once per step for every layer: nothing here for numba to compile.)"""
    shown = mask != -np.inf
    n_seen = shown.sum(axis=1, dtype=np.int64)
    alone = ~(shown & (shown.sum(axis=0) > 1)).any(axis=1)
    cells = np.zeros(mask.shape, dtype=np.int32)
    rows, cols = np.nonzero(shown)  # row by row, each row's cells ascending
    firsts = np.cumsum(n_seen) - n_seen
    cells[rows, np.arange(rows.size) - firsts[rows]] = cols
    return alone, n_seen, cells


def _scratch_floats(n_kv: int, d: int, dv: int) -> int:
    """Floats of one slot of working arrays: 64 lanes of dv sums, n_kv scores, 64 lanes of a
    dot, a query rounded to F16."""
    return 64 * dv + n_kv + 64 + d


def attention_scratch(n_rows: int, n_kv: int, d: int, dv: int) -> np.ndarray:
    """Working arrays for attention_cells over at most n_rows (head, token) rows of at most n_kv
    cells: a slot for each chunk of rows the threads take (rows.chunking; one a row for a
    decoding step's few), each used by its rows one after another - zeroed, as each row leaves
    its lanes' sums (made in Python: nothing for numba to compile in the kernel)."""
    return np.zeros((chunking(n_rows)[0], _scratch_floats(n_kv, d, dv)), dtype=f32)


SIZES_CELLS = 10  # which of attention_call's sizes is the number of cells


def attention_call(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head_kv: int, mask: np.ndarray, alone: np.ndarray,
                   n_seen: np.ndarray, cells: np.ndarray, scratch: np.ndarray, scale, softcap,
                   out: np.ndarray, sinks: np.ndarray | None = None) -> tuple[RowCall, np.ndarray]:
    """attention_cells' rows ((head, token) pairs) as a call of the row kernel
    _attention_rows_at (rows.RowCall), and the sizes it reads by address, which the caller holds
    as long as the call: sizes[10] is the number of cells, which a plan may lower from step to
    step (the mask and the row cells then laid out for that many).  ``scratch``:
    attention_scratch()'s, for at least these rows and cells.  ``sinks``: float32 [n_head], an
    attention sink per head (gpt-oss), held by the caller as long as the call."""
    if not (q.ndim == 3 and mask.ndim == 2 and out.ndim == 3 and k.ndim == 2 and v.ndim == 2
            and c_rows(f32, q, mask, out, scratch) and scratch.ndim == 2 and c_rows(np.bool_, alone)
            and c_rows(np.int64, n_seen) and c_rows(np.int32, cells)
            and k.dtype in (np.uint16, f32) and v.dtype in (np.uint16, f32)
            and k.strides[1] == k.itemsize and v.strides[1] == v.itemsize
            and k.strides[0] % k.itemsize == 0 and v.strides[0] % v.itemsize == 0):
        raise ValueError("attention: q, mask, out and the row cells must be C-contiguous, of their types, a cell's K and "
                         "V values side by side")
    # the C function takes these shapes as given: every cell and row it reads or writes must be there
    n_head, n_tok, d = q.shape
    n_kv = mask.shape[1]
    if not (mask.shape[0] >= n_tok and n_kv <= min(k.shape[0], v.shape[0]) and n_head_kv > 0
            and k.shape[1] == n_head_kv * d and n_head % n_head_kv == 0 and v.shape[1] % n_head_kv == 0
            and out.shape[0] == n_tok and out.shape[1] == n_head and out.shape[2] * n_head_kv == v.shape[1]
            and alone.shape[0] >= n_tok and n_seen.shape[0] >= n_tok and cells.ndim == 2 and cells.shape[0] >= n_tok
            and cells.shape[1] == n_kv):
        raise ValueError("attention: the shapes of q, k, v, mask, out and the row cells do not agree")
    if sinks is not None and not (sinks.ndim == 1 and c_rows(f32, sinks) and sinks.shape[0] == n_head):
        raise ValueError("attention: sinks must be C-contiguous float32, one per head")
    n_chunks, per = chunking(n_head * n_tok)
    slot = scratch.shape[1]
    if scratch.shape[0] < n_chunks or slot < _scratch_floats(n_kv, d, out.shape[2]):
        raise ValueError("attention: the scratch is too small for these rows")
    # (SIZES_CELLS: the cells' entry; the last, how many rows use a slot of the scratch: a chunk's)
    sizes = np.array([n_head, n_tok, d, k.shape[0], k.strides[0] // k.itemsize, k.shape[1], v.shape[0],
                      v.strides[0] // v.itemsize, v.shape[1], n_head_kv, n_kv, slot, max(per, 1),
                      address_of(sinks) if sinks is not None else 0], dtype=np.int64)
    at, args = _attention_rows_at(k.dtype, v.dtype)
    call = rows_call(at, n_head * n_tok,
                     args(q_at=address_of(q), k_at=address_of(k), v_at=address_of(v), mask_at=address_of(mask),
                          out_at=address_of(out), alone_at=address_of(alone), n_seen_at=address_of(n_seen),
                          seen_at=address_of(cells), sizes_at=address_of(sizes), scratch_at=address_of(scratch),
                          scale=float(f32(scale)), softcap=float(f32(softcap))))
    return call, sizes


@functools.cache
def _attention_rows_at(k_dtype: np.dtype, v_dtype: np.dtype) -> tuple[int, type]:
    """The address of attention's rows as a row kernel (rows.py) for caches of these element
    types, and its argument record: compiled once, not copied into a parallel loop's kernel."""
    kt, vt = k_dtype.type, v_dtype.type

    def attention_rows(start, end, q_at, k_at, v_at, mask_at, out_at, alone_at, n_seen_at, seen_at, sizes_at,
                       scratch_at, scale, softcap):
        """attention_cells' rows start..end (head h, token t at h * n_tokens + t), row r with the
        working arrays of slot r // sizes[12] of the scratch at ``scratch_at`` (sizes[11] floats
        a slot: a chunk's rows share one, one after another): the C function's own code, not a
        function it inlines (numba would copy that one's code).  No array expressions or
        allocations in it: numba makes each a parallel loop, or a function, of its own."""
        sizes = carray(pointer(sizes_at, np.int64), (14,))
        n_head, n_tok, d, k_cells, k_stride, k_width = sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5]
        v_cells, v_stride, v_width, n_head_kv, n_kv, slot = sizes[6], sizes[7], sizes[8], sizes[9], sizes[10], sizes[11]
        per_slot = sizes[12]
        q = carray(pointer(q_at, np.float32), (n_head, n_tok, d))
        k = carray(pointer(k_at, kt), (k_cells, k_stride))[:, :k_width]
        v = carray(pointer(v_at, vt), (v_cells, v_stride))[:, :v_width]
        mask = carray(pointer(mask_at, np.float32), (n_tok, n_kv))
        out = carray(pointer(out_at, np.float32), (n_tok, n_head, v_width // n_head_kv))
        alone = carray(pointer(alone_at, np.bool_), (n_tok,))
        n_seen = carray(pointer(n_seen_at, np.int64), (n_tok,))
        seen = carray(pointer(seen_at, np.int32), (n_tok, n_kv))
        dv = v_width // n_head_kv
        scale32, softcap32 = f32(scale), f32(softcap)
        for r in range(start, end):
            at = scratch_at + 4 * (r // per_slot) * slot  # (attention_scratch's layout: _scratch_floats)
            acc = carray(pointer(at, np.float32), (64, dv))  # zeroed: _sum_lanes leaves it so
            s = carray(pointer(at + 4 * 64 * dv, np.float32), (n_kv,))
            lanes = carray(pointer(at + 4 * (64 * dv + n_kv), np.float32), (64,))
            q16 = carray(pointer(at + 4 * (64 * dv + n_kv + 64), np.float32), (d,))
            t = r % n_tok
            sink = f32(-np.inf) if sizes[13] == 0 else carray(pointer(sizes[13], np.float32), (n_head,))[r // n_tok]
            _attention_row(r // n_tok, t, q, k, v, n_head_kv, mask, scale32, softcap32, out, alone[t], n_seen[t],
                           seen[t], q16, s, lanes, acc, sink)

    attention_rows.__qualname__ = f"attention_rows_{k_dtype.name}_{v_dtype.name}"  # one cache entry each
    return row_kernel(attention_rows), row_args(attention_rows)


@_jit
def _attention_row(h, t, q, k, v, n_head_kv, mask, scale, softcap, out, single, m, cells, q16, s, lanes, acc, sink):
    """attention_cells for head h of token t, which sees the m cells ``cells[:m]``; ``single``: t is
    the only token of its sequence here; ``sink``: the head's attention sink (-inf: none).  q16, s,
    lanes and acc: scratch."""
    n_head, n_tok, d = q.shape
    n_kv = mask.shape[1]
    dv = v.shape[1] // n_head_kv
    group = n_head // n_head_kv
    # tinyBLAS takes only inner sizes in whole 16s (llamafile_sgemm returns false otherwise):
    # ggml then multiplies by ggml_vec_dot_f16, for a batch as for a single token
    tiny_kq = not single and d % 16 == 0
    ko, vo = (h // group) * d, (h // group) * dv
    for i in range(d):
        q16[i] = round_f16(q[h, t, i])
    # the row's scores: the cells it sees in ascending order; the others hold the 0 that
    # their exponential is (softmax of -inf), so that every sum adds what it added over them
    for c in range(n_kv):
        s[c] = 0.0
    for i in range(m):
        c = cells[i]
        krow = k[c, ko:ko + d]
        kq = _dot_tinyblas(krow, q16, lanes) if tiny_kq else _dot_vec_f16(krow, q16, lanes)
        if softcap != 0.0:
            kq = f32(math.tanh(kq * f32(scale / softcap))) * f32(softcap)
        else:
            kq = kq * f32(scale)
        s[c] = kq + mask[t, c]
    if m:
        _softmax_seen_call(s, n_kv, cells, m, sink)
    else:  # a row that sees no cell: NaN everywhere, as the softmax of -inf everywhere gives
        for c in range(n_kv):
            s[c] = np.nan
    for i in range(m if m else n_kv):
        c = cells[i] if m else i
        p = round_f16(s[c])
        if p == 0.0:
            continue
        lane = c & 63 if single else c & 15
        _add_scaled(acc[lane], v[c, vo:vo + dv], p)
    _sum_lanes(acc, out[t, h], single)


def by_cell(kv: np.ndarray) -> np.ndarray:
    """A K or V cache view [n_head_kv, cells, d] as [cells, n_head_kv * d] (attention_cells'
    layout): the cache's own bytes when its heads lie side by side in each cell, a copy if not."""
    heads, cells, d = kv.shape
    flat = kv.transpose(1, 0, 2)
    if flat.strides[1] == d * kv.itemsize and flat.strides[2] == kv.itemsize and flat.strides[0] >= heads * d * kv.itemsize:
        return np.lib.stride_tricks.as_strided(flat, (cells, heads * d), (flat.strides[0], kv.itemsize))
    return np.ascontiguousarray(flat).reshape(cells, heads * d)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float, softcap: float,
              out: np.ndarray) -> None:
    """q [n_head, n_tokens, d]; k [n_head_kv, n_kv, d] and v [n_head_kv, n_kv, dv]: float32 values or
    F16 bits; mask [n_tokens, n_kv] -> out [n_tokens, n_head, dv] (attention_cells)."""
    attention_cells(np.ascontiguousarray(q, dtype=np.float32), by_cell(k), by_cell(v), k.shape[0],
                    np.ascontiguousarray(mask, dtype=np.float32), scale, softcap, out)


# -- selection ---------------------------------------------------------------------------------------

@_jit
def _any_above(x, i, t):
    """Whether one of x[i:i + 16] is above t (a NaN is not)."""
    above = False
    for j in range(16):
        above |= x[i + j] > t
    return above


@_jit
def _worse(va, ia, vb, ib):
    """Whether (value va, index ia) ranks below (vb, ib): smaller value, or equal and later."""
    return va < vb or (va == vb and ia > ib)


@_jit
def _insert(hv, hi, at, v, j):
    """Put (v, j) in its place among the entries before ``at`` (ranked, best first), moving the
    worse ones down over the entry at ``at``."""
    while at > 0 and _worse(hv[at - 1], hi[at - 1], v, j):
        hv[at], hi[at] = hv[at - 1], hi[at - 1]
        at -= 1
    hv[at], hi[at] = v, j


def top_k_rows(x: np.ndarray, k: int, out: np.ndarray) -> None:
    """out[r, :k] = the indices of the k largest values of row r of x [rows, n] (k <= n), largest
    first, equal values lowest index first; NaN ranks below every number.  One pass per row,
    the k best so far kept ranked: a value enters only when it beats the worst of them (rare once
    they are warm: at most n * k moves for a row). In this thread: a sampler's row, or an expert
    router's few values per token."""
    if not (x.ndim == 2 and out.ndim == 2 and out.shape[0] >= x.shape[0] and 0 < k <= min(x.shape[1], out.shape[1])):
        raise ValueError(f"top_k: k = {k} of rows {x.shape} into {out.shape}")
    if k == 1:  # greedy sampling's: numpy's argmax (the first of equal values) where no row's largest is NaN
        best = x.argmax(axis=1)
        if not np.isnan(x[np.arange(x.shape[0]), best]).any():
            out[:x.shape[0], 0] = best
            return
    _top_k_rows(x, k, out, np.empty(k, dtype=f32), np.empty(k, dtype=np.int64))  # (the k best: made here)


@njit(**KERNEL)
def _top_k_rows(x, k, out, hv, hi):
    for r in range(x.shape[0]):
        _top_k_row(x[r], k, out[r], hv, hi)


@_jit
def _top_k_row(x, k, out, hv, hi):
    """top_k_rows of one row, its k best so far ranked in values hv and indices hi."""
    n = x.shape[0]
    for i in range(k):
        v = x[i]
        _insert(hv, hi, i, v if v == v else f32(-np.inf), i)
    i = k
    while i < n:
        # most values beat no entry once the k are warm: a group of 16 is looked at one by one
        # only when one of them does (the test over the group vectorizes)
        end = min(i + 16, n)
        if end - i == 16 and not _any_above(x, i, hv[k - 1]):
            i = end
            continue
        for j in range(i, end):
            v = x[j]
            if v > hv[k - 1]:  # strictly: an equal value comes later, so it ranks below
                _insert(hv, hi, k - 1, v, j)
        i = end
    for i in range(k):
        out[i] = hi[i]


# -- what warmup.py compiles of these kernels (pyggml/cpu/parts.py) -----------------------------
@part("norms", 1.7, LAYERS)
def _compile_norms() -> None:
    """The row kernels of norms, RoPE and the cache writes (their calls made, not run: the
    table that runs them is a part of its own), and RoPE's angles."""
    x = sample_x(2)
    rms_norm_call(x, 1e-6, np.empty_like(x))
    row = x[:1]
    add_rms_norm_mul_call(row, row, True, np.empty_like(row), 1e-6, x[0].copy(), np.empty_like(row),
                          np.empty_like(row))
    cos, sin = rope_cache(np.arange(2), 16, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 4096, np.ones(1, dtype=f32), False)
    q = x.reshape(1, 2, 8, 32)[:, :, :1, :16].copy()
    rope_call(q, np.empty_like(q), cos, sin, 16, True)
    set_rows_f16_call(x, np.arange(2, dtype=np.int64), np.zeros((4, x.shape[1]), dtype=np.uint16))  # KV cache writes
    elementwise_call(ADD, x, x, np.empty_like(x))  # residual adds, weights, scales


@part("attention", 3.0, LAYERS)
def _compile_attention() -> None:
    """Attention's rows over an F16 cache (a call made, not run)."""
    q = np.ones((1, 2, 64), dtype=f32)
    cells = np.zeros((2, 64), dtype=np.uint16)  # an F16 cache's cells, as FLASH_ATTN_EXT reads them
    mask = np.zeros((2, 2), dtype=f32)
    alone, n_seen, seen = row_cells(mask)
    attention_call(q, cells, cells, 1, mask, alone, n_seen, seen, attention_scratch(2, 2, 64, 64), f32(0.125),
                   f32(0.0), np.empty((2, 1, 64), dtype=f32))


@part("top_k", 0.8, LAYERS)
def _compile_top_k() -> None:  # the sampler's (and TOP_K's)
    x = sample_x(2)
    top_k_rows(x, 2, np.empty((2, 2), dtype=np.int64))


@part("swiglu", 1.1, GATES)
def _compile_swiglu() -> None:  # a feed-forward's gate (the plain SiLU of UNARY: when used)
    x = sample_x(2)
    swiglu_call(x, x, np.empty_like(x))


@part("geglu", 0.4, GATES)
def _compile_geglu() -> None:
    x = sample_x(2)
    geglu_call(x, x, np.empty_like(x))


@part("softmax", 0.7)
def _compile_softmax() -> None:  # SOFT_MAX: the experts' routers (attention has its own)
    softmax_call(sample_x(2))

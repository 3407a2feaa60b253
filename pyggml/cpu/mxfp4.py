"""MXFP4 weights (gpt-oss's experts) times Q8_0 activations, with ggml's exact arithmetic.

ggml's ``ggml_vec_dot_mxfp4_q8_0`` (AVX2, and the same code on AVX-512 machines) takes two
blocks per step, each into an accumulator of its own::

    lane l of block b:  S[b, l] = sum of kvalues[w[i]] * y[i] over the block's elements 4l..4l+3
    acc_even[l] = fma(d_y[b] * e8m0_half(e_w[b]), S[b, l], acc_even[l])     (b = 0, 2, 4 ...)
    acc_odd[l]  = the same for b = 1, 3, 5 ...
    result = hsum8(acc_even + acc_odd), then an odd last block added as d * (its integer sum)

llama.cpp multiplies MXFP4 with this one function at every batch size (llamafile's tiled
kernels do not take it), so every element of a product is this sum.  The integer sums are
exact in any order; the float steps are ggml's, one rounding each.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quants.layouts import KVALUES_MXFP4
from .simd import KERNEL, fma32

f32 = np.float32
BLOCK, BLOCK_BYTES = 32, 17
_KV = KVALUES_MXFP4.astype(np.int32)


@njit(inline="always", **KERNEL)
def e8m0_half(e):
    """ggml_e8m0_to_fp32_half: 2**(e - 128) as float32 (e < 2: subnormal bits)."""
    e = np.uint32(e)
    bits = np.uint32(np.uint32(0x00200000) << e) if e < np.uint32(2) else np.uint32((e - np.uint32(1)) << np.uint32(23))
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


@njit(inline="always", **KERNEL)
def _decode_row(w, wv, scales):
    """A weight row's values (the doubled e2m1 codes, int32) and its blocks' halved scales."""
    for b in range(scales.size):
        at = b * BLOCK_BYTES
        scales[b] = e8m0_half(w[at])
        for j in range(16):
            q = np.int64(w[at + 1 + j])
            wv[b * BLOCK + j] = _KV[q & 15]
            wv[b * BLOCK + 16 + j] = _KV[q >> 4]


@njit(inline="always", **KERNEL)
def _block_into(acc, scale, wv, y, o):
    """acc[l] = fma(scale, the block's lane sum l, acc[l]) for the block at element o."""
    for lane in range(8):
        i = o + 4 * lane
        s = wv[i] * y[i] + wv[i + 1] * y[i + 1] + wv[i + 2] * y[i + 2] + wv[i + 3] * y[i + 3]
        acc[lane] = fma32(scale, f32(s), acc[lane])


@njit(inline="always", **KERNEL)
def mxfp4_dot(wv, scales, y, yd, acc1, acc2):
    """One decoded weight row times one Q8_0 activation row (int32 values, float32 scales)."""
    nb = scales.size
    for lane in range(8):
        acc1[lane] = f32(0.0)
        acc2[lane] = f32(0.0)
    ib = 0
    while ib + 1 < nb:
        _block_into(acc1, f32(yd[ib] * scales[ib]), wv, y, ib * BLOCK)
        _block_into(acc2, f32(yd[ib + 1] * scales[ib + 1]), wv, y, (ib + 1) * BLOCK)
        ib += 2
    v = np.empty(8, dtype=np.float32)
    for lane in range(8):
        v[lane] = acc1[lane] + acc2[lane]
    total = f32(f32(f32(v[0] + v[4]) + f32(v[2] + v[6])) + f32(f32(v[1] + v[5]) + f32(v[3] + v[7])))
    if ib < nb:  # an odd last block: its integer sum times its scale (one fused step, as GCC contracts it)
        s = 0
        for i in range(ib * BLOCK, ib * BLOCK + BLOCK):
            s += wv[i] * y[i]
        total = fma32(f32(yd[ib] * scales[ib]), f32(s), total)
    return total


@njit(parallel=True, **KERNEL)
def mxfp4_matmul(w, yq, yd, out, runs):
    """out[n, m] = row m of w (MXFP4, uint8 [M, K/32*17]) . column n of the Q8_0 activations
    (yq [N, K] integer values as float32, yd float32 [N, K/32]); ``runs`` as qdot's (each run's
    columns alone: the dot of one column does not depend on the others, so runs change nothing
    here).  Each weight row is decoded once, for every column."""
    n_rows, n_cols = w.shape[0], yq.shape[0]
    nb = yd.shape[1]
    y = np.empty((n_cols, nb * BLOCK), dtype=np.int32)
    for n in range(n_cols):
        for j in range(nb * BLOCK):
            y[n, j] = np.int32(yq[n, j])
    for m in prange(n_rows):
        wv = np.empty(nb * BLOCK, dtype=np.int32)
        scales = np.empty(nb, dtype=np.float32)
        acc1 = np.empty(8, dtype=np.float32)
        acc2 = np.empty(8, dtype=np.float32)
        _decode_row(w[m], wv, scales)
        for n in range(n_cols):
            out[n, m] = mxfp4_dot(wv, scales, y[n], yd[n], acc1, acc2)

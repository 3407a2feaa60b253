"""The activation side of ggml's CPU matrix products, reproduced exactly.

ggml never multiplies quantized weights with float activations: it first converts each
activation row to the weight type's ``vec_dot_type`` (Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL, Q8_1
for Q4_1/Q5_1, Q8_K for the K-quants and IQ4_XS, F16 for F16 weights) and computes
integer block dot products.  We decode weights to float32 instead, which is exact for the
weight side, and apply the same activation quantization here, as float values
``q * d`` - so our products equal ggml's up to float summation order.  Without this the
two drift apart by ~0.5% per product and, through 30 layers, flip near-tied argmaxes.

Details that matter (checked against llama.cpp's intermediate tensors):
- Q8_0/Q8_1 as x86's SIMD code does it: ``q = rint(x * 127/amax)``, ``d`` stored as F16.
- Q8_1 also stores ``s = F16(d * sum(q))`` and ggml's Q4_1/Q5_1 dot uses it for the
  block minimum: ``d_w d_x sum(q_w q_x) + m_w s``.  ``q8_1_correction`` adds the difference
  ``m_w (s - d_F16 sum(q))`` that decoding alone misses.
- Q8_K: ``iscale = -127/max`` (max = the signed value of largest magnitude),
  ``q = min(127, rint(iscale x))``, ``d = 1/iscale`` in float32.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..types import Type

F32, F16, Q8_0, Q8_1, Q8_K = 0, 1, 2, 3, 4

VEC_DOT_KIND = {
    Type.Q4_0: Q8_0, Type.Q5_0: Q8_0, Type.Q8_0: Q8_0, Type.IQ4_NL: Q8_0,
    Type.Q4_1: Q8_1, Type.Q5_1: Q8_1,
    Type.Q2_K: Q8_K, Type.Q3_K: Q8_K, Type.Q4_K: Q8_K, Type.Q5_K: Q8_K, Type.Q6_K: Q8_K, Type.IQ4_XS: Q8_K,
    Type.F16: F16,
}


@njit(cache=True, inline="always")
def round_f16(v):
    """The float16 value nearest to ``v`` (ties to even), as float32."""
    a = abs(v)
    if a == 0.0 or not math.isfinite(a):
        return v
    if a >= 65520.0:
        return math.copysign(math.inf, v)
    if a < 6.103515625e-05:             # subnormal halves: a fixed quantum of 2**-24
        quantum = 5.960464477539063e-08
    else:
        quantum = math.ldexp(1.0, math.frexp(a)[1] - 11)
    return np.float32(math.copysign(np.rint(a / quantum) * quantum, v))


@njit(cache=True, parallel=True)
def quantize_activations(x, kind, corr):
    """x [N, K] float32 -> the values ggml's vec_dot_type holds; for Q8_1 also fills
    corr [N, K/32] with s - d*sum(q) per block (see q8_1_correction)."""
    n_rows, k = x.shape
    out = np.empty_like(x)
    block = 256 if kind == Q8_K else 32
    for r in prange(n_rows):
        if kind == F16:
            for i in range(k):
                out[r, i] = round_f16(x[r, i])
            continue
        for b in range(k // block):
            lo = b * block
            if kind == Q8_K:
                amax, vmax = np.float32(0.0), np.float32(0.0)
                for i in range(lo, lo + block):
                    if abs(x[r, i]) > amax:
                        amax, vmax = abs(x[r, i]), x[r, i]
                if amax == 0.0:
                    out[r, lo:lo + block] = 0.0
                    continue
                iscale = np.float32(-127.0) / vmax
                d = np.float32(1.0) / iscale
                for i in range(lo, lo + block):
                    out[r, i] = min(np.float32(127.0), np.rint(iscale * x[r, i])) * d
                continue
            amax = np.float32(0.0)
            for i in range(lo, lo + block):
                amax = max(amax, abs(x[r, i]))
            d = amax / np.float32(127.0)
            ident = np.float32(127.0) / amax if amax != 0.0 else np.float32(0.0)
            d16 = round_f16(d)
            qsum = np.float32(0.0)
            for i in range(lo, lo + block):
                q = np.rint(x[r, i] * ident)
                qsum += q
                out[r, i] = q * d16
            if kind == Q8_1:
                corr[r, b] = round_f16(d * qsum) - d16 * qsum
    return out


@njit(cache=True, parallel=True)
def q8_1_correction(w, corr, out, block_bytes, f16):
    """out[n, m] += sum_b m_w[m, b] * corr[n, b]: the block minima of Q4_1/Q5_1 rows (an
    F16 at byte 2 of each block) times the Q8_1 sum correction."""
    n_blocks = corr.shape[1]
    for m in prange(w.shape[0]):
        for n in range(corr.shape[0]):
            acc = np.float32(0.0)
            for b in range(n_blocks):
                p = b * block_bytes + 2
                acc += f16[np.int64(w[m, p]) | (np.int64(w[m, p + 1]) << 8)] * corr[n, b]
            out[n, m] += acc

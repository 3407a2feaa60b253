"""Quantized matrix products with ggml's exact arithmetic (llama.cpp's x86 build).

ggml multiplies a weight row with an activation row quantized to 8 bits (activations.py) by
integer dot products per block, then accumulates in float32.  For a single column
(``vec_dot``, AVX2 code) through 8 SIMD lanes::

    lane l of block b:  S[b, l] = sum of w[i] * y[i] over the block's elements 4l..4l+3
                        (of every 32-element chunk, for the 256-element K-quant blocks)
    acc[l] = fma(scale_w[b] * scale_y[b], S[b, l], acc[l])        for b in order
    result = hsum8(acc) + (the block minima's term, for Q4_1/Q5_1/Q4_K/Q5_K)

For batches llama.cpp takes other kernels, with other float steps: repacked Q4_K
(``gemv``/``gemm_q4_K_8x8_q8_K``) and, from 8 columns, its tiled K-quant matmul; the chains
below and blockdot.py reproduce each.  The integer sums are exact, so we compute them however
is fastest: 8-bit dot products (``simd.dot4``, ``vpdpbusd`` where there is AVX-512 VNNI),
float32 (every 4-value sum stays below 2**24) for single columns of Q4_K/Q5_K, int32/int64 for
block sums; only the float steps keep ggml's order.

Two ways through: blockdot.py reads the GGUF blocks in registers, one row and column at a time
(single columns of the 32-element types, Q6_K and repacked Q4_K; batches of the last two);
the rest is unpacked one row at a time (as bytes, or as exact integers times the sub-block
scale for K-quants) and used at once for every column.

``EXACT`` lists the weight types done this way; qmatmul.py routes the others (F16, IQ4,
Q2_K, Q3_K) through decode-and-dot, exact up to summation order.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..types import Type
from .blockdot import FORMATS, column_format, row_dot, row_pair_dots
from .qdecode import _h, _k4_scale_min, _qh32, _u, _zero
from .simd import fma32, lane_chain8, lane_chain8x2, lane_dots, lane_dots_signed

f32 = np.float32

# unpacker numbers (the order of the if-chain in ``unpack``)
EXACT = {Type.Q4_0: 0, Type.Q4_1: 1, Type.Q5_0: 2, Type.Q5_1: 3, Type.Q8_0: 4,
         Type.Q4_K: 5, Type.Q5_K: 6, Type.Q6_K: 7}
# llama.cpp repacks Q4_K weights of a multiple of 8 rows (its CPU_REPACK buffer, q4_K_8x8 on
# AVX2 machines) and multiplies them with other code: whole-block integer sums, no lanes
Q4_K_X8 = 8
# how the lanes are scaled and summed: 32-element blocks (Q8_0 activations), the same plus
# the minimum's term (Q8_1), 256-element K-quant blocks with mins kept per lane group
# (Q4_K), with mins summed in one scalar (Q5_K), without mins (Q6_K)
FAM_Q8_0, FAM_Q8_1, FAM_K4, FAM_K5, FAM_K6, FAM_K4_X8 = 0, 1, 2, 3, 4, 5
INT8_MIN_COLS = 4
# weights with signed values (Q4_0: q - 8, Q5_0: q - 16, Q8_0) go through lane_dots_signed
SIGNED = (True, False, True, False, True, False, False, False, False)
# from this many columns on llama.cpp multiplies K-quant weights (not repacked ones) in tiles
TILED_MIN_COLS = 8
FROM_BLOCKS = tuple(k for k in FORMATS if k <= Q4_K_X8)  # single columns of these go through blockdot.py
BATCHES_FROM_BLOCKS = (7, Q4_K_X8)  # and batches of these (Q6_K, repacked Q4_K)
FAMILY = (FAM_Q8_0, FAM_Q8_1, FAM_Q8_0, FAM_Q8_1, FAM_Q8_0, FAM_K4, FAM_K5, FAM_K6, FAM_K4_X8)

_jit = njit(cache=True, inline="always", boundscheck=False)


# -- weights: one row into exact integers (as float32) and per-block scales ----------------------
# ``one * float(q) + zero``: the same value, but LLVM vectorizes these loops only when the
# conversion feeds float arithmetic (measured 5x faster); ``one``/``zero`` come from the half
# table so that the compiler cannot fold them away.

@_jit
def _int_nibbles(row, wq, wd, wm, f16, size, has_min, five, offset):
    """Q4_0/Q4_1 (four bits in nibbles) and Q5_0/Q5_1 (a fifth from the 32-bit qh): q - offset;
    d (and m) per block.  Without a fifth bit the opaque zero is OR-ed in its place."""
    z = _zero(f16)
    one, zero = f16[15360], f16[0]
    qs = (4 if has_min else 2) + (4 if five else 0)
    shift = 4 if five else 0
    for b in range(wq.size // 32):
        p, o = b * size, b * 32
        wd[b] = _h(row, p, f16)
        if has_min:
            wm[b] = _h(row, p + 2, f16)
        hi = _qh32(row, p + qs - 4) if five else z
        for j in range(16):
            q = _u(row, p + qs + j)
            wq[o + j] = one * np.float32(((q & 15) | (((hi >> j) & 1) << shift)) - offset) + zero
            wq[o + 16 + j] = one * np.float32(((q >> 4) | (((hi >> (j + 16)) & 1) << shift)) - offset) + zero


@_jit
def _int_q8_0(row, wq, wd, f16):
    z = _zero(f16)
    one, zero = f16[15360], f16[0]
    for b in range(wq.size // 32):
        p, o = b * 34, b * 32
        wd[b] = _h(row, p, f16)
        for j in range(32):
            wq[o + j] = one * np.float32(np.int8(_u(row, p + 2 + j) | ((z >> j) & 1))) + zero


@_jit
def _int_qk(row, wq, wd, wm, wmin, f16, five):
    """Q4_K / Q5_K: q * scale per 32-element sub-block; d, dmin per block; the sub-block mins."""
    one, zero = f16[15360], f16[0]
    size = 176 if five else 144
    qs = 48 if five else 16
    for b in range(wq.size // 256):
        p, o = b * size, b * 256
        wd[b], wm[b] = _h(row, p, f16), _h(row, p + 2, f16)
        for s in range(8):
            sc, mn = _k4_scale_min(row, p + 4, s)
            wmin[b * 8 + s] = np.float32(mn)
            shift = 4 * (s & 1)
            for l in range(32):
                q = (_u(row, p + qs + (s // 2) * 32 + l) >> shift) & 15
                if five:
                    q |= ((_u(row, p + 16 + l) >> s) & 1) << 4
                wq[o + s * 32 + l] = one * np.float32(q * sc) + zero


@_jit
def unpack(kind, row, wq, wd, wm, wmin, f16):
    if kind == 0:
        _int_nibbles(row, wq, wd, wm, f16, 18, False, False, 8)
    elif kind == 1:
        _int_nibbles(row, wq, wd, wm, f16, 20, True, False, 0)
    elif kind == 2:
        _int_nibbles(row, wq, wd, wm, f16, 22, False, True, 16)
    elif kind == 3:
        _int_nibbles(row, wq, wd, wm, f16, 24, True, True, 0)
    elif kind == 4:
        _int_q8_0(row, wq, wd, f16)
    elif kind == 5:
        _int_qk(row, wq, wd, wm, wmin, f16, False)
    else:
        _int_qk(row, wq, wd, wm, wmin, f16, True)


@_jit
def lane_scales(kind, row, ls):
    """The sub-block scale of every lane of a Q4_K/Q5_K row - to take apart the scaled integers
    for lane_dots."""
    size = 176 if kind == 6 else 144
    for b in range(ls.size // 64):
        for s in range(8):
            sc = np.float32(_k4_scale_min(row, b * size + 4, s)[0])
            for u in range(b * 64 + s * 8, b * 64 + s * 8 + 8):
                ls[u] = sc


# -- the float steps, in ggml's order ---------------------------------------------------------------

@_jit
def _chain32(S, wd, wm, yd, ys, with_min):
    """Q4_0/Q5_0/Q8_0 (and with the minimum, Q4_1/Q5_1): one fma per lane per 32-block, the
    minimum's term ``summs = fma(m_w, s_y, summs)`` in a scalar of its own."""
    summs = f32(0.0)
    if with_min:
        for b in range(wd.size):
            summs = fma32(wm[b], ys[b], summs)
    return lane_chain8(S, wd, yd, wd.size) + summs


@_jit
def _block_sum(S, lo, hi):
    """The exact integer sum of S[lo:hi] (in integers: the compiler may add them in any order,
    and a block's sum can pass float32's 2**24; 64 lanes stay far below 2**31)."""
    total = np.int32(0)
    for u in range(lo, hi):
        total += np.int32(S[u])
    return np.int64(total)


@_jit
def _lane256(S, b, lane):
    """A lane's integer over a 256-block: its 4-value sums of all 8 chunks."""
    o = b * 64 + lane
    return ((np.int64(S[o]) + np.int64(S[o + 8])) + (np.int64(S[o + 16]) + np.int64(S[o + 24]))) + \
        ((np.int64(S[o + 32]) + np.int64(S[o + 40])) + (np.int64(S[o + 48]) + np.int64(S[o + 56])))


@_jit
def _mins_sum(wmin, ys, b, j0, j1):
    """Sum of min x (32-value activation sum) over the sub-blocks j0..j1 of block b (integers)."""
    total = np.int32(0)  # min < 64, a 32-value sum < 2**12: far inside int32
    for j in range(j0, j1):
        total += np.int32(wmin[b * 8 + j]) * (np.int32(ys[b * 16 + 2 * j]) + np.int32(ys[b * 16 + 2 * j + 1]))
    return np.int64(total)


@_jit
def _chain256(S, L, wd, wm, wmin, yd, ys, fam):
    """Q4_K/Q5_K: each lane's integer over a 256-block (into L, rounded to float32 as ggml's
    int->float conversion does), one fma per lane per block; the mins' term either in 4 lanes
    (Q4_K) or one scalar (Q5_K).  ys holds the activations' bsums (16 per block); wmin the
    sub-block mins (8 per block).  (Q6_K: blockdot.py.)"""
    m0 = m1 = m2 = m3 = summs = f32(0.0)
    for b in range(wd.size):
        for lane in range(8):
            L[b * 8 + lane] = np.float32(_lane256(S, b, lane))
        dmin = -yd[b] * wm[b]
        # mins x the activations' 32-value sums (ggml: hadd of bsums), in pairs of sub-blocks
        p0, p1 = np.float32(_mins_sum(wmin, ys, b, 0, 2)), np.float32(_mins_sum(wmin, ys, b, 2, 4))
        p2, p3 = np.float32(_mins_sum(wmin, ys, b, 4, 6)), np.float32(_mins_sum(wmin, ys, b, 6, 8))
        if fam == FAM_K4:
            m0, m1 = fma32(dmin, p0, m0), fma32(dmin, p1, m1)
            m2, m3 = fma32(dmin, p2, m2), fma32(dmin, p3, m3)
        else:  # Q5_K: summed as integers first
            summs = fma32(dmin, np.float32(_mins_sum(wmin, ys, b, 0, 8)), summs)
    if fam == FAM_K4:
        summs = (m0 + m2) + (m1 + m3)
    return lane_chain8(L, yd, wd, wd.size) + summs


@_jit
def _chain_tiled(S, wd, wm, wmin, yd, ys, fam):
    """Q4_K/Q5_K with 8 or more columns: llama.cpp's tiled matmul (AVX-512 VNNI kernel).  Per
    256-block the integer sums of the scales' and the mins' terms; ``r = float(s1) * d``,
    ``r = fma(-dmin, float(s2), r)``, then ``acc = fma(r, d_y, acc)``.  (Q6_K: blockdot.py.)"""
    acc = f32(0.0)
    for b in range(wd.size):
        r = np.float32(_block_sum(S, b * 64, b * 64 + 64)) * wd[b]
        r = fma32(-wm[b], np.float32(_mins_sum(wmin, ys, b, 0, 8)), r)
        acc = fma32(r, yd[b], acc)
    return acc


@_jit
def _lane_sums(wq, yn, S, n_lanes):
    """S[u] = the integer sum of the products of lane group u (exact in float32)."""
    for u in range(n_lanes):
        i = 4 * u
        S[u] = (wq[i] * yn[i] + wq[i + 1] * yn[i + 1]) + (wq[i + 2] * yn[i + 2] + wq[i + 3] * yn[i + 3])


@_jit
def _scale_lanes(S, ls, n_lanes):
    """Each lane times its sub-block scale (K-quants; exact integers)."""
    for u in range(n_lanes):
        S[u] *= ls[u]


@_jit
def _dots(codes, yb, S, signed):
    if signed:
        lane_dots_signed(codes, yb, S, codes.size // 64)
    else:
        lane_dots(codes, yb, S, codes.size // 64)


@_jit
def _legacy_row_pair(kind, w, m, yb, yd, ys, out, f16, codes, S, wd, wm, wmin):
    """Rows m and m + 1 of a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weight for every column: their two lane
    chains run side by side (lane_chain8x2), each hiding the other's fma latency."""
    signed, with_min = SIGNED[kind], FAMILY[kind] == FAM_Q8_1
    unpack(kind, w[m], codes[0], wd[0], wm[0], wmin, f16)
    unpack(kind, w[m + 1], codes[1], wd[1], wm[1], wmin, f16)
    nb = wd.shape[1]
    for n in range(yb.shape[0]):
        _dots(codes[0], yb[n], S[0], signed)
        _dots(codes[1], yb[n], S[1], signed)
        a, b = lane_chain8x2(S, wd, yd[n], nb)
        if with_min:
            sa = sb = f32(0.0)
            for j in range(nb):
                sa = fma32(wm[0, j], ys[n, j], sa)
                sb = fma32(wm[1, j], ys[n, j], sb)
            a, b = a + sa, b + sb
        out[n, m], out[n, m + 1] = a, b


@_jit
def _to_bytes(yq, yb):
    for i in range(yq.size):
        yb[i] = np.int8(yq[i])


@_jit
def _rows_from_blocks(kind, w, start, end, yb, yd, ys, out):
    """Rows start..end of a weight for every column, two at a time (blockdot.py)."""
    n_cols = yb.shape[0]
    for m in range(start, end - 1, 2):
        for n in range(n_cols):
            fmt = column_format(kind, n, n_cols, TILED_MIN_COLS)
            out[n, m], out[n, m + 1] = row_pair_dots(fmt, w[m], w[m + 1], yb[n], yd[n], ys[n])
    if (end - start) % 2:
        for n in range(n_cols):
            out[n, end - 1] = row_dot(column_format(kind, n, n_cols, TILED_MIN_COLS), w[end - 1], yb[n], yd[n], ys[n])


@njit(parallel=True, cache=True, boundscheck=False)
def exact_matmul(kind, w, yq, yd, ys, out, f16):
    """out[n, m] = vec_dot(w[m], y[n]) for quantized weight rows w (uint8 [M, row_bytes]) and
    activations quantized by activations.quantize_q8 (yq [N, K] integers, yd/ys per block).

    With several columns the lane sums are 8-bit integer dot products (``simd.lane_dots``):
    the weights' and the activations' integers as bytes, once per row or column; for a
    single column the float loop is quicker than that conversion."""
    m_rows, n_cols, k = w.shape[0], yq.shape[0], yq.shape[1]
    n_lanes = k // 4
    fam, signed = FAMILY[kind], SIGNED[kind]
    k64 = (k + 63) // 64 * 64  # lane_dots takes 64 bytes at a time: zero padding
    batched = n_cols >= INT8_MIN_COLS
    # products that blockdot.py reads straight from the GGUF blocks: decode steps, and batches of K-quants
    from_blocks = kind in FROM_BLOCKS and (not batched or kind in BATCHES_FROM_BLOCKS)
    # the legacy types' integers fit a byte as unpacked: those always take lane_dots
    as_bytes = batched or fam <= FAM_Q8_1 or from_blocks
    yb = np.zeros((n_cols if as_bytes else 0, k64), dtype=np.int8)
    if batched:
        for n in prange(yb.shape[0]):
            _to_bytes(yq[n], yb[n])
    else:  # a few hundred values: less than starting the threads
        for n in range(yb.shape[0]):
            _to_bytes(yq[n], yb[n])
    n_chunks = min(m_rows, 64)
    per = (m_rows + n_chunks - 1) // n_chunks
    if from_blocks:
        for c in prange(n_chunks):
            _rows_from_blocks(kind, w, c * per, min(m_rows, (c + 1) * per), yb, yd, ys, out)
        return
    for c in prange(n_chunks):
        wq = np.empty(k, dtype=np.float32)
        ls = np.ones(n_lanes, dtype=np.float32)
        codes = np.zeros(k64, dtype=np.int8)  # unsigned codes (at most 63) read the same as bytes
        wd = np.empty(k // 32 if fam <= FAM_Q8_1 else k // 256, dtype=np.float32)
        wm = np.zeros_like(wd)
        wmin = np.zeros(k // 16, dtype=np.float32)
        S = np.empty(k64 // 4, dtype=np.float32)
        L = np.empty(k // 32, dtype=np.float32)
        codes2 = np.zeros((2, k64), dtype=np.int8)
        S2 = np.empty((2, k64 // 4), dtype=np.float32)
        wd2 = np.empty((2, wd.size), dtype=np.float32)
        wm2 = np.zeros((2, wd.size), dtype=np.float32)
        start, end = c * per, min(m_rows, (c + 1) * per)
        pairs = (end - start) // 2 if fam <= FAM_Q8_1 else 0
        for p in range(pairs):
            _legacy_row_pair(kind, w, start + 2 * p, yb, yd, ys, out, f16, codes2, S2, wd2, wm2, wmin)
        for m in range(start + 2 * pairs, end):
            if fam <= FAM_Q8_1:
                unpack(kind, w[m], codes, wd, wm, wmin, f16)  # straight into bytes
            else:
                unpack(kind, w[m], wq, wd, wm, wmin, f16)
                if batched:  # K-quants: unpack scaled the codes, lane_dots wants them bare
                    lane_scales(kind, w[m], ls)
                    for i in range(k):
                        scale = ls[i >> 2]
                        codes[i] = wq[i] / scale if scale != 0 else 0
            for n in range(n_cols):
                if as_bytes:
                    _dots(codes, yb[n], S, signed)
                    if fam > FAM_Q8_1:
                        _scale_lanes(S, ls, n_lanes)
                else:
                    _lane_sums(wq, yq[n], S, n_lanes)
                if fam <= FAM_Q8_1:
                    out[n, m] = _chain32(S, wd, wm, yd[n], ys[n], fam == FAM_Q8_1)
                elif n_cols >= TILED_MIN_COLS:
                    out[n, m] = _chain_tiled(S, wd, wm, wmin, yd[n], ys[n], fam)
                else:
                    out[n, m] = _chain256(S, L, wd, wm, wmin, yd[n], ys[n], fam)

"""Quantized matrix products with ggml's exact arithmetic (llama.cpp's x86 build).

ggml multiplies a weight row with an activation row quantized to 8 bits (activations.py) by
integer dot products per block, then accumulates in float32.  For a single column
(``vec_dot``, AVX2 code) through 8 SIMD lanes::

    lane l of block b:  S[b, l] = sum of w[i] * y[i] over the block's elements 4l..4l+3
                        (of every 32-element chunk, for the 256-element K-quant blocks)
    acc[l] = fma(scale_w[b] * scale_y[b], S[b, l], acc[l])        for b in order
    result = hsum8(acc) + (the block minima's term, for Q4_1/Q5_1/Q4_K/Q5_K)

For batches llama.cpp takes other kernels, with other float steps: repacked Q4_K
(``gemv``/``gemm_q4_K_8x8_q8_K``) and, from 8 columns, its tiled K-quant matmul; blockdot.py
reproduces each.  The integer sums are exact, so we compute them however is fastest: 8-bit
dot products (``simd.dot4``, ``vpdpbusd`` where there is AVX-512 VNNI); only the float steps
keep ggml's order.

Two ways through: blockdot.py reads the GGUF blocks in registers, one row and column at a time
(every single column - a decode step - and every batch of K-quants); batches of the 32-element
types unpack each pair of weight rows into bytes once and dot it with two columns at a time
(``simd.block_dots_2x2``: four block-dot chains in one loop).

``kinds.EXACT`` lists the weight types done this way; qmatmul.py routes the others (F16, IQ4,
Q2_K, Q3_K) through decode-and-dot, exact up to summation order.
"""
from __future__ import annotations

import functools

import numpy as np
import numba
from numba import njit, prange
from numba.extending import overload

from .blockdot import FORMATS, LEGACY, column_format, row_pair_dots
from .kinds import Fmt, kernel_of_kind, literal_kind
from .qdecode import f16_at, opaque_zero, u32_at, u8_at
from .simd import block_dots_2x2_min, block_dots_2x2_signed, fma32, lane_chain8, lane_dots, lane_dots_signed

f32 = np.float32

# from this many columns the legacy types' integers are unpacked once per row for all columns
INT8_MIN_COLS = 4


@njit(cache=True, inline="always")
def with_min(kind):
    """Whether a 32-element format has a block minimum (Q4_1, Q5_1); the others' weights are
    signed (Q4_0: q - 8, Q5_0: q - 16, Q8_0) and go through the signed dot products.  A test,
    not a tuple indexed by kind: numba may hoist a loop-invariant index out of a parallel loop,
    where it would raise for the formats that never reach it."""
    return kind == Fmt.Q4_1 or kind == Fmt.Q5_1


# from this many columns on llama.cpp multiplies K-quant weights (not repacked ones) in tiles
TILED_MIN_COLS = 8
assert set(Fmt) == set(FORMATS), "blockdot.py lacks a format"

_jit = njit(cache=True, inline="always", boundscheck=False)


# -- weights: one row into exact integers and per-block scales ------------------------------------
# ``one * float(q) + zero``: the same value, but LLVM vectorizes these loops only when the
# conversion feeds float arithmetic; ``one``/``zero`` come from the half table so that the
# compiler cannot fold them away.

@_jit
def _int_nibbles(row, wq, wd, wm, f16, size, has_min, five, offset):
    """Q4_0/Q4_1 (four bits in nibbles) and Q5_0/Q5_1 (a fifth from the 32-bit qh): q - offset;
    d (and m) per block.  Without a fifth bit the opaque zero is OR-ed in its place."""
    z = opaque_zero(f16)
    one, zero = f16[15360], f16[0]
    qs = (4 if has_min else 2) + (4 if five else 0)
    shift = 4 if five else 0
    for b in range(wd.size):  # the row's blocks: wq may be longer (zero padding to 64)
        p, o = b * size, b * 32
        wd[b] = f16_at(row, p, f16)
        if has_min:
            wm[b] = f16_at(row, p + 2, f16)
        hi = u32_at(row, p + qs - 4) if five else z
        for j in range(16):
            q = u8_at(row, p + qs + j)
            wq[o + j] = one * np.float32(((q & 15) | (((hi >> j) & 1) << shift)) - offset) + zero
            wq[o + 16 + j] = one * np.float32(((q >> 4) | (((hi >> (j + 16)) & 1) << shift)) - offset) + zero


@_jit
def _int_q8_0(row, wq, wd, f16):
    z = opaque_zero(f16)
    one, zero = f16[15360], f16[0]
    for b in range(wd.size):
        p, o = b * 34, b * 32
        wd[b] = f16_at(row, p, f16)
        for j in range(32):
            wq[o + j] = one * np.float32(np.int8(u8_at(row, p + 2 + j) | ((z >> j) & 1))) + zero


def unpack(kind, row, wq, wd, wm, f16):
    """A row of a 32-element format (kind, known when the kernel is compiled) into integers and
    per-block scales (and minima)."""
    raise TypeError("unpack is called from numba kernels only")


@overload(unpack, prefer_literal=True, inline="always")
def _unpack(kind, row, wq, wd, wm, f16):
    blk = LEGACY[Fmt(literal_kind(kind, "unpack"))]
    if blk.bytes8:
        return lambda kind, row, wq, wd, wm, f16: _int_q8_0(row, wq, wd, f16)
    size, has_min, five, offset = blk.size, blk.has_min, blk.five, blk.offset
    return lambda kind, row, wq, wd, wm, f16: _int_nibbles(row, wq, wd, wm, f16, size, has_min, five, offset)


@_jit
def _chain32(S, wd, wm, yd, ys, with_min):
    """Q4_0/Q5_0/Q8_0 (and with the minimum, Q4_1/Q5_1): one fma per lane per 32-block, the
    minimum's term ``summs = fma(m_w, s_y, summs)`` in a scalar of its own."""
    summs = f32(0.0)
    if with_min:
        for b in range(wd.size):
            summs = fma32(wm[b], ys[b], summs)
    return lane_chain8(S, wd, yd, wd.size) + summs


def block_dots(kind, codes, yb, S):
    """simd.lane_dots of a row unpacked into bytes with an activation column: signed weights
    unless the format has a minimum (kind known when the kernel is compiled)."""
    raise TypeError("block_dots is called from numba kernels only")


@overload(block_dots, prefer_literal=True)
def _block_dots(kind, codes, yb, S):
    dots = lane_dots if with_min.py_func(literal_kind(kind, "block_dots")) else lane_dots_signed
    return lambda kind, codes, yb, S: dots(codes, yb, S, codes.size // 64)


def block_dots_2x2(kind, codes, wd, wm, yb, yd, ys, n, n1, nb):
    """simd.block_dots_2x2 for a format with a minimum or one of signed weights (kind known when
    the kernel is compiled)."""
    raise TypeError("block_dots_2x2 is called from numba kernels only")


@overload(block_dots_2x2, prefer_literal=True, inline="always")
def _block_dots_2x2(kind, codes, wd, wm, yb, yd, ys, n, n1, nb):
    dots = block_dots_2x2_min if with_min.py_func(literal_kind(kind, "block_dots_2x2")) else block_dots_2x2_signed
    return lambda kind, codes, wd, wm, yb, yd, ys, n, n1, nb: dots(codes, wd, wm, yb, yd, ys, n, n1, nb)


@_jit
def _legacy_row_pair(kind, w, m, yb, yd, ys, out, f16, codes, wd, wm):
    """Rows m and m + 1 of a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weight for every column, two columns at a
    time: four block-dot chains in one loop (simd.block_dots_2x2)."""
    for i in range(2):  # one call site: each is a copy of the unpacking code
        unpack(kind, w[m + i], codes[i], wd[i], wm[i], f16)
    nb, n_cols = wd.shape[1], yb.shape[0]
    for n in range(0, n_cols, 2):
        n1 = min(n + 1, n_cols - 1)  # an odd last column goes with itself
        a0, b0, a1, b1 = block_dots_2x2(kind, codes, wd, wm, yb, yd, ys, n, n1, nb)
        out[n, m], out[n, m + 1] = a0, b0
        out[n1, m], out[n1, m + 1] = a1, b1


@_jit
def _to_bytes(yq, yb):
    for i in range(yq.size):
        yb[i] = np.int8(yq[i])


@_jit
def _rows_from_blocks(kind, w, start, end, yb, yd, ys, out, runs):
    """Rows start..end of a weight for every column, two at a time (blockdot.py); an odd last
    row goes with itself.  A column's format is the one a product of its run's columns alone
    would give it (runs: the runs' first columns, then the number of columns)."""
    for r in range(runs.size - 1):
        r0, r1 = runs[r], runs[r + 1]
        for n in range(r0, r1):  # a column's format and rows taken once for the chunk's rows (in cache)
            fmt = column_format(kind, n - r0, r1 - r0, TILED_MIN_COLS)
            y, d, s = yb[n], yd[n], ys[n]
            for m in range(start, end, 2):
                m1 = min(m + 1, end - 1)
                out[n, m], out[n, m1] = row_pair_dots(kind, fmt, w[m], w[m1], y, d, s)


@_jit
def _chunks(m_rows, n_chunks):
    """How a product's rows are cut into at most n_chunks: (number of chunks, rows per chunk),
    whole pairs of rows per chunk (only the last may end on an odd one)."""
    n_chunks = min(m_rows, n_chunks)
    per = (m_rows + n_chunks - 1) // n_chunks
    per += per % 2
    return (m_rows + per - 1) // per, per


def rows_chunk(kind, w, start, end, yb, yd, ys, out, f16, batched, runs):
    """Rows start..end of weight w times every column of yb: one thread's part of a product.
    Single columns and the K-quants straight from the GGUF blocks (blockdot.py); batches of the
    32-element types through rows unpacked into bytes, two rows with two columns at a time
    (the same float steps as one column's, so their runs need nothing).  A function of its own,
    not the parallel loop's body: numba's parallel passes then take seconds less to compile.
    (Unlike attention's rows - nn.attention_cells - this costs no speed: the block kernels are
    LLVM IR of our own, vectorized as written, not by LLVM's alias analysis of numba's arrays.)"""
    raise TypeError("rows_chunk is called from numba kernels only")


@overload(rows_chunk, prefer_literal=True)
def _rows_chunk_for(kind, w, start, end, yb, yd, ys, out, f16, batched, runs):
    if literal_kind(kind, "rows_chunk") > Fmt.Q8_0:
        return lambda kind, w, start, end, yb, yd, ys, out, f16, batched, runs: \
            _rows_from_blocks(kind, w, start, end, yb, yd, ys, out, runs)
    return lambda kind, w, start, end, yb, yd, ys, out, f16, batched, runs: \
        _legacy_rows_chunk(kind, w, start, end, yb, yd, ys, out, f16, batched, runs)


@_jit
def _legacy_rows_chunk(kind, w, start, end, yb, yd, ys, out, f16, batched, runs):
    """rows_chunk for the 32-element formats."""
    if not batched:
        _rows_from_blocks(kind, w, start, end, yb, yd, ys, out, runs)
        return
    k64, nb = yb.shape[1], yd.shape[1]
    codes = np.zeros((2, k64), dtype=np.int8)
    S = np.empty((2, k64 // 4), dtype=np.float32)
    wd = np.empty((2, nb), dtype=np.float32)
    wm = np.zeros((2, nb), dtype=np.float32)
    for m in range(start, end - 1, 2):
        _legacy_row_pair(kind, w, m, yb, yd, ys, out, f16, codes, wd, wm)
    if (end - start) % 2:
        m = end - 1
        unpack(kind, w[m], codes[0], wd[0], wm[0], f16)  # straight into bytes
        for n in range(yb.shape[0]):
            block_dots(kind, codes[0], yb[n], S[0])
            out[n, m] = _chain32(S[0], wd[0], wm[0], yd[n], ys[n], with_min(kind))


@njit(cache=True, boundscheck=False)
def _rows_chunk(kind, w, start, end, yb, yd, ys, out, f16, batched, runs):
    """rows_chunk in a function of its own, compiled once per kind (numba compiles an overload
    anew in each function that calls it)."""
    rows_chunk(kind, w, start, end, yb, yd, ys, out, f16, batched, runs)


@njit(parallel=True, cache=True, boundscheck=False)
def _activation_bytes(yq, parallel):
    """The quantized activations as int8 rows zero-padded to whole 64s (lane_dots' step)."""
    n_cols, k = yq.shape
    yb = np.zeros((n_cols, (k + 63) // 64 * 64), dtype=np.int8)
    if parallel:
        for n in prange(n_cols):
            _to_bytes(yq[n], yb[n])
    else:  # a few hundred values: less than starting the threads
        for n in range(n_cols):
            _to_bytes(yq[n], yb[n])
    return yb


def exact_quant_matmul(kind: int, w, yq, yd, ys, out, f16, runs) -> None:
    """out[n, m] = vec_dot(w[m], y[n]) for quantized weight rows w (uint8 [M, row_bytes]) of
    format ``kind`` (a kinds.Fmt) and activations quantized by activations.quantize_q8 (yq [N,
    K] integers, yd/ys per block); each run of columns (runs: int64 [first column of each
    run..., N], checked by the caller) computed as a product of its columns alone would be -
    [0, N]: the whole batch."""
    product_kernel(int(kind))(w, yq, yd, ys, out, f16, runs, THREADS)


def exact_quant_matmul_id(kind: int, w, yq, yd, ys, experts, starts, out, f16) -> None:
    """MUL_MAT_ID's products in one parallel loop: for each group g, the columns
    starts[g]..starts[g + 1] of the activations (quantized, yq/yd/ys as exact_quant_matmul's)
    times expert experts[g] of w (uint8 [n_expert, M, row_bytes]), into the same rows of out
    [columns, M].  Each group is computed as exact_quant_matmul computes a product of its
    columns alone (the kernels for a batch depend on its size)."""
    _products_of(int(kind))[1](w, yq, yd, ys, experts, starts, out, f16)


# the most threads a parallel loop uses (numba.set_num_threads may lower it, not raise it)
THREADS = numba.config.NUMBA_NUM_THREADS


def product_kernel(kind: int):
    """The numba kernel of exact_quant_matmul for weights of format ``kind``: the same arguments
    but the kind, and THREADS last (a caller that multiplies again and again holds it)."""
    return _products_of(kind)[0]


@functools.cache
def _products_of(kind: int):
    """The two product kernels of one weight format.  ``kind`` is a constant of the kernels, so
    that each compiles the code of its format only (rows_chunk and the functions it calls choose
    theirs when compiled): a model compiles the formats it has, not all thirteen."""
    def product(w, yq, yd, ys, out, f16, runs, threads):
        m_rows, n_cols = w.shape[0], yq.shape[0]
        batched = n_cols >= INT8_MIN_COLS
        yb = _activation_bytes(yq, batched)
        # one column: a chunk per thread (numba gives each thread one contiguous range anyway, and
        # each chunk is a call); more: chunks whose rows stay in cache from column to column
        n_chunks, per = _chunks(m_rows, threads if n_cols == 1 else 64)
        for c in prange(n_chunks):
            _rows_chunk(kind, w, c * per, min(m_rows, (c + 1) * per), yb, yd, ys, out, f16, batched, runs)

    def product_id(w, yq, yd, ys, experts, starts, out, f16):
        m_rows, n_groups = w.shape[1], experts.size
        yb = _activation_bytes(yq, True)
        n_chunks, per = _chunks(m_rows, 64)  # the groups' chunks in one range: many, for a fair share
        whole = _group_runs(starts)
        for j in prange(n_groups * n_chunks):
            g, c = j // n_chunks, j % n_chunks
            s0, s1 = starts[g], starts[g + 1]
            _rows_chunk(kind, w[experts[g]], c * per, min(m_rows, (c + 1) * per), yb[s0:s1], yd[s0:s1], ys[s0:s1],
                        out[s0:s1], f16, s1 - s0 >= INT8_MIN_COLS, whole[g])
    return tuple(kernel_of_kind(fn, Fmt(kind).name, parallel=True, cache=True, boundscheck=False)
                 for fn in (product, product_id))


@njit(cache=True)
def _group_runs(starts):
    """Each group of MUL_MAT_ID's one run of its own columns: [[0, columns of group g]...]."""
    whole = np.zeros((starts.size - 1, 2), dtype=np.int64)
    for g in range(starts.size - 1):
        whole[g, 1] = starts[g + 1] - starts[g]
    return whole

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

blockdot.py reads the GGUF blocks in registers: two rows with one column (a decode step), or
with eight, four or two columns at once where a batch has them (each block unpacked once for all).

``kinds.EXACT`` lists the weight types done this way; qmatmul.py routes the others (F16, IQ4,
Q2_K, Q3_K) through decode-and-dot, exact up to summation order.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import numba
from numba import carray, njit, types

from ..batch_rules import BATCH_RULES
from .blockdot import FORMATS, LANE_SUMS, TILE_MID, TILE_NARROW, TILE_WIDE, column_format, row_pair_dots, tile_dots
from .kinds import Fmt, kernel_of_kind
from .parts import kind_part
from .rows import RowCall, address_of, c_rows, product_call, row_args, row_kernel, run_calls, serial_call
from .simd import KERNEL, pointer


# from this many columns on llama.cpp multiplies K-quant weights (not repacked ones) in tiles
TILED_MIN_COLS = BATCH_RULES.tiled_min_cols
assert set(Fmt) == set(FORMATS), "blockdot.py lacks a format"

_jit = njit(inline="always", **KERNEL)


@_jit
def _tile_rows(kind, fmt, n_cols, w, start, end, yb, yd, ys, n, out):
    """Rows start..end, two at a time, times columns n .. n + n_cols - 1 (n_cols a constant)."""
    for m in range(start, end, 2):
        m1 = min(m + 1, end - 1)
        tile_dots(kind, fmt, n_cols, w[m], w[m1], yb, yd, ys, n, out, m, m1)


@_jit
def _column(kind, fmt, w, start, end, yb, yd, ys, n, out):
    """Rows start..end, two at a time (an odd last row with itself), times column n."""
    y, d, s = yb[n], yd[n], ys[n]
    for m in range(start, end, 2):
        m1 = min(m + 1, end - 1)
        out[n, m], out[n, m1] = row_pair_dots(kind, fmt, w[m], w[m1], y, d, s)


@_jit
def _product_arrays(w_at, m_rows, row_bytes, yb_at, n_cols, yb_width, yd_at, yd_width, ys_at, ys_width, out_at, m_out,
                    runs_at, n_runs):
    """A product's arrays as its rows' C functions take them by address."""
    return (carray(pointer(w_at, np.uint8), (m_rows, row_bytes)),
            carray(pointer(yb_at, np.int8), (n_cols, yb_width)),
            carray(pointer(yd_at, np.float32), (n_cols, yd_width)),
            carray(pointer(ys_at, np.float32), (n_cols, ys_width)),
            carray(pointer(out_at, np.float32), (n_cols, m_out)),
            carray(pointer(runs_at, np.int64), (n_runs,)))


@_jit
def _tile_width(fmts, n):
    """How many columns from n a tile takes: the widest of TILE_WIDE, TILE_MID and TILE_NARROW
    whose columns exist and share a format, else 1."""
    for width in (TILE_WIDE, TILE_MID, TILE_NARROW):
        same = n + width <= fmts.size
        for c in range(1, width if same else 1):
            same = same and fmts[n + c] == fmts[n]
        if same:
            return width
    return 1


@_jit
def _chunks(m_rows, n_chunks):
    """How a product's rows are cut into at most n_chunks: (number of chunks, rows per chunk),
    whole pairs of rows per chunk (only the last may end on an odd one); none for no rows."""
    if m_rows == 0:
        return 0, 2
    n_chunks = min(m_rows, n_chunks)
    per = (m_rows + n_chunks - 1) // n_chunks
    per += per % 2
    return (m_rows + per - 1) // per, per


def activation_bytes_width(k: int, offset: int) -> int:
    """The width of the activations' rows as bytes (_activation_bytes_rows) for k activations."""
    return (k + 63) // 64 * 64 + (k if offset else 0)


@_jit
def _activation_bytes_row(yq, n, offset, yb):
    """Row n of the quantized activations yq as bytes into yb's row n (every byte of it
    written): int8 zero-padded to whole 64s; with an ``offset`` (not 0), the row then holds its
    32-value blocks' lane sums times -offset, as int32 (blockdot.LANE_SUMS)."""
    k = yq.shape[1]
    padded = (k + 63) // 64 * 64
    for i in range(k):
        yb[n, i] = np.int8(yq[n, i])
    for i in range(k, yb.shape[1]):
        yb[n, i] = 0
    if offset:
        sums = yb[n, padded:].view(np.int32)
        for j in range(k // 4):
            sums[j] = -offset * np.int32(yq[n, 4 * j] + yq[n, 4 * j + 1] + yq[n, 4 * j + 2] + yq[n, 4 * j + 3])


def _activation_bytes_rows(start, end, yq_at, k, yb_at, width, offset, i5, i6, i7, i8, i9, f0, f1):
    """Rows start..end of the activations as bytes (_activation_bytes_row; a row kernel: rows.py),
    in the calling thread: a pass over the activations, a small part of a product's time."""
    yq = carray(pointer(yq_at, np.float32), (end, k))
    yb = carray(pointer(yb_at, np.int8), (end, width))
    for n in range(start, end):
        _activation_bytes_row(yq, n, offset, yb)


ActivationBytesArgs = row_args(_activation_bytes_rows)


@functools.cache
def activation_bytes_at() -> int:
    return row_kernel(_activation_bytes_rows)


def product_calls(kind: int, w: np.ndarray, yq: np.ndarray, yd: np.ndarray, ys: np.ndarray, yb: np.ndarray,
                  out: np.ndarray, runs: np.ndarray) -> list[RowCall]:
    """A product of weight rows w in format ``kind`` (a kinds.Fmt) with quantized activations
    (yq, yd, ys) into out, as calls (rows.RowCall): the activations' bytes into ``yb``
    (activation_bytes_width wide), then the rows of w in chunks - one per thread for a single
    column; for more, chunks whose rows stay in cache from column to column, by the format's
    tiled rows (or, while those compile, the rows that take a column at a time: tiles_deferred).
    The caller has checked that w's rows hold yq's blocks, and checks the runs' values (rising
    from 0 to the columns) before the calls run; it holds every array as long as the calls."""
    (m_rows, row_bytes), (n_cols, k) = w.shape, yq.shape
    sums = lane_sums(kind)
    if not (w.ndim == 2 and yq.ndim == 2 and c_rows(np.uint8, w) and c_rows(np.float32, yq, yd, ys, out)
            and c_rows(np.int8, yb) and c_rows(np.int64, runs) and runs.ndim == 1 and runs.size >= 2
            and yd.shape[0] == ys.shape[0] == n_cols and out.shape[0] == n_cols and out.shape[1] >= m_rows
            and yb.shape == (n_cols, activation_bytes_width(k, sums))):
        raise ValueError("a product's arrays must be C-contiguous, of agreeing shapes")
    n_chunks, per = row_chunks(m_rows, n_cols)
    ints = (address_of(w), m_rows, row_bytes, 0, 0, address_of(yb), n_cols, yb.shape[1], address_of(yd), yd.shape[1],
            address_of(ys), ys.shape[1], address_of(out), out.shape[1], address_of(runs), runs.size)
    if n_cols == 1:
        rows = product_call(column_rows(kind).rows_at, m_rows, n_chunks, per, ints)
    else:  # (while the tiled rows are deferred: the kernel in the format's slot when the table runs)
        at, by_slot = batch_rows(kind)
        rows = product_call(at, m_rows, n_chunks, per, ints, by_slot=by_slot)
    return [serial_call(activation_bytes_at(), n_cols, ActivationBytesArgs(yq_at=address_of(yq), k=k, yb_at=address_of(yb),
                                                                          width=yb.shape[1], offset=sums)), rows]


def exact_quant_matmul(kind: int, w, yq, yd, ys, out, runs) -> None:
    """out[n, m] = vec_dot(w[m], y[n]) for quantized weight rows w (uint8 [M, row_bytes]) of
    format ``kind`` (a kinds.Fmt) and activations quantized by activations.quantize_q8 (yq [N,
    K] integers, yd/ys per block); each run of columns (runs: int64 [first column of each
    run..., N]) computed as a product of its columns alone would be - [0, N]: the whole batch."""
    if not (runs.ndim == 1 and runs.size >= 2 and runs[0] == 0 and runs[-1] == yq.shape[0]
            and (np.diff(runs) >= 0).all()):
        raise ValueError("a product's runs must rise from 0 to its columns")
    yb = np.empty((yq.shape[0], activation_bytes_width(yq.shape[1], lane_sums(kind))), dtype=np.int8)
    run_calls(product_calls(kind, w, yq, yd, ys, yb, out, runs))


# the most threads a parallel loop uses (numba.set_num_threads may lower it, not raise it)
THREADS = numba.config.NUMBA_NUM_THREADS


class ProductKernel(NamedTuple):
    """What the products of one weight format call: the address of its rows' C function, and
    the offset whose lane sums its activation bytes carry (blockdot.LANE_SUMS; 0: none)."""
    rows_at: int
    lane_sums: int


def lane_sums(kind: int) -> int:
    """The offset whose lane sums a format's activation bytes carry (blockdot.LANE_SUMS; 0: none)."""
    return LANE_SUMS.get(Fmt(kind), 0)


def product_kernel(kind: int) -> ProductKernel:
    """The product kernel of one weight format (kinds.Fmt): its tiled rows, for any columns."""
    return _kernel_of(int(kind))  # an int: numba types an IntEnum constant as no literal


def column_rows(kind: int) -> ProductKernel:
    """A weight format's rows that take a column at a time: a decoding step's (one column), and
    every product's while the tiled rows compile (tiles_deferred).  The same bits as the tiled
    rows: a tile only shares each block's unpacking between its columns."""
    return _columns_of(int(kind))


# Per format, the address of the rows a deferred product's calls run (rows.PRODUCT_BY_SLOT):
# column_rows' while the tiled rows compile in other processes, theirs once this process has
# them.  A new machine's first answer thus waits for neither the tiled rows' compile (about
# half of a model's) nor a plan built again after it.
_SLOTS = np.zeros(max(Fmt) + 1, dtype=np.int64)
_DEFERRED: set[int] = set()


def tiles_deferred(kind: int) -> None:
    """Products of this format run column_rows (by the format's slot) until tiles_ready."""
    kind = int(kind)
    _SLOTS[kind] = column_rows(kind).rows_at
    _DEFERRED.add(kind)


def tiles_ready(kind: int) -> None:
    """The format's tiled rows (compiled, or loaded from the cache) in its slot: what the calls
    made while they were deferred run from then on, and what new calls take."""
    kind = int(kind)
    _SLOTS[kind] = product_kernel(kind).rows_at  # (an aligned 8-byte store: a running table reads one or the other)
    _DEFERRED.discard(kind)


def batch_rows(kind: int) -> tuple[int, bool]:
    """Where a table's product of several columns finds its rows' C function: (the tiled rows'
    address, False), or while they are deferred (the address of the format's slot, True: the
    kernel there when the table runs)."""
    if kind in _DEFERRED:
        return address_of(_SLOTS[kind:kind + 1]), True
    return product_kernel(kind).rows_at, False


def row_chunks(m_rows: int, n_cols: int) -> tuple[int, int]:
    """How a product's rows are cut for the threads: one chunk per thread for a single column
    (a decoding step's), many for more (a fair share, and rows that stay in cache)."""
    return _chunks.py_func(m_rows, THREADS if n_cols == 1 else 64)


@functools.cache
def _columns_of(kind: int) -> ProductKernel:
    """column_rows, as _kernel_of's C function for one format."""
    def rows_columns(w_at, m_rows, row_bytes, start, end, yb_at, n_cols, yb_width, yd_at, yd_width, ys_at, ys_width,
                     out_at, m_out, runs_at, n_runs):
        """rows_chunk's products a column at a time (two rows at a time, an odd last row with
        itself), each column in its run's format."""
        w, yb, yd, ys, out, runs = _product_arrays(w_at, m_rows, row_bytes, yb_at, n_cols, yb_width, yd_at, yd_width,
                                                   ys_at, ys_width, out_at, m_out, runs_at, n_runs)
        for r in range(n_runs - 1):
            r0, r1 = runs[r], runs[r + 1]
            for n in range(r0, r1):
                _column(kind, column_format(kind, n - r0, r1 - r0, TILED_MIN_COLS), w, start, end, yb, yd, ys, n, out)

    rows = kernel_of_kind(rows_columns, Fmt(kind).name, cfunc=types.void(*[types.intp] * 16), **KERNEL)
    return ProductKernel(rows.address, lane_sums(kind))


@functools.cache
def _kernel_of(kind: int) -> ProductKernel:
    """The rows of one weight format's products as a C function (numba.cfunc), compiled for that
    format only: ``kind`` is a constant of it (the rows' code and the functions it calls choose
    their code when compiled), so a model compiles the formats it has, not all of them.

    The parallel loop around it (rows.run_table; experts.py's calls it too) is one kernel for every
    format, which calls it by its address, given at every call (a compiled kernel is cached on
    disk; an address is this process's): numba would copy a called function's code into each
    kernel that calls it, and optimize and compile it again there - twice for a parallel loop,
    seconds per format - and a loop of each format's own was a second of compile more per
    format for the same machine code."""
    def rows_chunk(w_at, m_rows, row_bytes, start, end, yb_at, n_cols, yb_width, yd_at, yd_width, ys_at, ys_width,
                   out_at, m_out, runs_at, n_runs):
        """Rows start..end of weight w times every column of yb - one thread's part of a product -
        two rows at a time (blockdot.py), and TILE_WIDE (or TILE_MID, TILE_NARROW) columns at a
        time where that many consecutive columns share a format (each block then unpacked once
        for all of them); an odd last row goes with itself.  A column's format is the one a
        product of its run's columns alone would give it (runs: the runs' first columns, then
        the number of columns) - a tile may span runs: its columns' sums are apart.  The C
        function's own code, not a function it inlines: numba would copy that one's code (and
        run its passes again) for every format."""
        w, yb, yd, ys, out, runs = _product_arrays(w_at, m_rows, row_bytes, yb_at, n_cols, yb_width, yd_at, yd_width,
                                                   ys_at, ys_width, out_at, m_out, runs_at, n_runs)
        fmts = np.empty(n_cols, dtype=np.int64)
        for r in range(n_runs - 1):
            r0, r1 = runs[r], runs[r + 1]
            for n in range(r0, r1):
                fmts[n] = column_format(kind, n - r0, r1 - r0, TILED_MIN_COLS)
        n = 0
        while n < n_cols:  # a column's rows taken once for the chunk's rows (in cache)
            fmt, width = fmts[n], _tile_width(fmts, n)
            if width == TILE_WIDE:  # (each width a constant of the tile's code)
                _tile_rows(kind, fmt, TILE_WIDE, w, start, end, yb, yd, ys, n, out)
            elif width == TILE_MID:
                _tile_rows(kind, fmt, TILE_MID, w, start, end, yb, yd, ys, n, out)
            elif width == TILE_NARROW:
                _tile_rows(kind, fmt, TILE_NARROW, w, start, end, yb, yd, ys, n, out)
            else:
                _column(kind, fmt, w, start, end, yb, yd, ys, n, out)
            n += width

    rows = kernel_of_kind(rows_chunk, Fmt(kind).name, cfunc=types.void(*[types.intp] * 16), **KERNEL)
    return ProductKernel(rows.address, lane_sums(kind))


# -- what warmup.py compiles of these kernels (pyggml/cpu/parts.py) -----------------------------
@kind_part("product", Fmt, lambda f: 0.5 if f <= Fmt.Q8_0 else 0.9)  # a K-quant block is larger IR
def _compile_product(fmt: Fmt) -> None:
    """A format's rows that take a column at a time (a C function): a decoding step's, and every
    product's until its tiled rows are compiled.  The parallel loops around them are parts of
    their own."""
    column_rows(fmt)


@kind_part("tiles", Fmt, lambda f: 0.8 if f <= Fmt.Q8_0 else 1.7)
def _compile_tiles(fmt: Fmt) -> None:
    """A format's tiled rows (about twice the column rows' compile): a first answer does not
    wait for them (warmup.Compiling.wait_for_first_answer)."""
    product_kernel(fmt)

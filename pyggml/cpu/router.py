"""The small ops of a mixture of experts' router as row kernels (rows.py), so that they join the
plan's table instead of running as Python steps between its tables.

A router's ops (SOFT_MAX over the experts' logits, TOP_K, GET_ROWS of the chosen probabilities,
SUM_ROWS, CLAMP and DIV to normalize them, MUL of each expert's output by its weight) touch a few
values per token: as numpy steps, each cost a decoding step 5-35 us of Python and cut the table
in two.  Here each is a row kernel with the arithmetic of the numpy step it replaces (and of
ggml's):

- softmax of scaled rows: each value times the scale in float32, then nn's softmax row;
- rows summed in double one value after the other, then rounded (``ggml_vec_sum_f32``);
- clamp as ggml's ``MAX(MIN(x, max), min)``;
- top k as nn.top_k_rows (largest first, equal values lowest index first, NaN last);
- a binary op with one value per row of b (ggml broadcasts b's single column);
- rows picked by ids that the step itself computes (GET_ROWS; ADD_ID, gpt-oss's expert biases,
  adds them to rows): an id outside the rows is noted by the kernel (which writes zeros there,
  reading nothing out of bounds) and raised by the step after the table (plan.TableStep.check).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from numba import carray

from .nn import ADD, DIV, MUL, SUB, _softmax_row, _top_k_row, rows_of
from .parts import LAYERS, part
from .rows import RowCall, address_of, c_rows, row_args, row_kernel, rows_call, serial_call
from .simd import pointer

f32 = np.float32


def _scaled_softmax_rows(start, end, x_at, out_at, n, i3, i4, i5, i6, i7, i8, i9, scale, f1):
    x, out = rows_of(x_at, end, n), rows_of(out_at, end, n)
    s = f32(scale)
    for r in range(start, end):
        for i in range(n):
            out[r, i] = x[r, i] * s
        _softmax_row(out[r], f32(-np.inf))


def _sum_rows(start, end, x_at, out_at, n, i3, i4, i5, i6, i7, i8, i9, f0, f1):
    x, out = rows_of(x_at, end, n), rows_of(out_at, end, 1)
    for r in range(start, end):
        total = 0.0
        for i in range(n):
            total += np.float64(x[r, i])
        out[r, 0] = f32(total)


def _clamp_rows(start, end, x_at, out_at, n, i3, i4, i5, i6, i7, i8, i9, lo, hi):
    x, out = rows_of(x_at, end, n), rows_of(out_at, end, n)
    low, high = f32(lo), f32(hi)
    for r in range(start, end):
        for i in range(n):
            v = x[r, i] if x[r, i] < high else high
            out[r, i] = v if v > low else low


def _top_k_rows(start, end, x_at, out_at, n, k, i4, i5, i6, i7, i8, i9, f0, f1):
    x = rows_of(x_at, end, n)
    out = carray(pointer(out_at, np.int32), (end, k))
    hv, hi, best = np.empty(k, dtype=f32), np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64)
    for r in range(start, end):
        _top_k_row(x[r], k, best, hv, hi)
        for i in range(k):
            out[r, i] = np.int32(best[i])


def _row_value_rows(start, end, a_at, b_at, out_at, n, b_step, op, i6, i7, i8, i9, f0, f1):
    """out[r] = a[r] (op) b[r * b_step]: one value of b for each row (b_step 0: one for all)."""
    a, out = rows_of(a_at, end, n), rows_of(out_at, end, n)
    b = carray(pointer(b_at, np.float32), ((end - 1) * b_step + 1,))
    for r in range(start, end):
        v = b[r * b_step]
        if op == ADD:
            for i in range(n):
                out[r, i] = a[r, i] + v
        elif op == SUB:
            for i in range(n):
                out[r, i] = a[r, i] - v
        elif op == MUL:
            for i in range(n):
                out[r, i] = a[r, i] * v
        else:
            for i in range(n):
                out[r, i] = a[r, i] / v


# GET_ROWS' picks: an int64 array of what _pick_rows reads
P_A, P_A_NB1, P_A_NB2, P_A_NB3, P_A_ROWS, P_IDS, P_IDS_NB0, P_IDS_NB1, P_IDS_NB2, P_N0, P_N1, P_OUT, P_ROW, \
    P_ADD, P_BAD, P_BAD_ID, P_SIZE = range(17)


def _pick_rows(start, end, desc_at, i1, i2, i3, i4, i5, i6, i7, i8, i9, f0, f1):
    """Rows start..end of GET_ROWS' output (float32 [rows, row]): output row r = (i0, i1, i2)
    of the ids' [n2, n1, n0] takes row ids[i2, i1, i0] of a's matrix (i1, i2), plus row r of
    the rows at desc[P_ADD] where that is not 0 (ADD_ID).  Strides in elements; an id outside
    a's rows writes zeros and is noted (desc[P_BAD], desc[P_BAD_ID])."""
    d = carray(pointer(desc_at, np.int64), (P_SIZE,))
    n0, n1, row = d[P_N0], d[P_N1], d[P_ROW]
    out = rows_of(d[P_OUT], end, row)
    added = rows_of(d[P_ADD] if d[P_ADD] else d[P_OUT], end, row)
    for r in range(start, end):
        i0, i1, i2 = r % n0, (r // n0) % n1, r // (n0 * n1)
        ids = carray(pointer(d[P_IDS] + 4 * (i0 * d[P_IDS_NB0] + i1 * d[P_IDS_NB1] + i2 * d[P_IDS_NB2]), np.int32), (1,))
        e = np.int64(ids[0])
        if e < 0 or e >= d[P_A_ROWS]:
            d[P_BAD_ID] = e
            d[P_BAD] = 1
            for i in range(row):
                out[r, i] = 0.0
            continue
        a = rows_of(d[P_A] + 4 * (e * d[P_A_NB1] + i1 * d[P_A_NB2] + i2 * d[P_A_NB3]), 1, row)
        if d[P_ADD]:
            for i in range(row):
                out[r, i] = added[r, i] + a[0, i]
        else:
            for i in range(row):
                out[r, i] = a[0, i]


ScaledSoftmaxArgs, SumArgs, ClampArgs, TopKArgs, RowValueArgs, PickArgs = (
    row_args(k) for k in (_scaled_softmax_rows, _sum_rows, _clamp_rows, _top_k_rows, _row_value_rows, _pick_rows))


@functools.cache
def _at(kernel) -> int:
    return row_kernel(kernel)


def _check_rows(what: str, *arrays: np.ndarray) -> None:
    if not c_rows(f32, *arrays) or any(a.ndim != 2 for a in arrays):
        raise ValueError(f"{what}: rows must be C-contiguous float32 [rows, n]")


def softmax_call(x: np.ndarray, out: np.ndarray, scale: float) -> RowCall:
    """out = softmax(x * scale) by rows [rows, n]."""
    _check_rows("softmax", x, out)
    if x.shape != out.shape:
        raise ValueError("softmax: x and out differ in shape")
    return rows_call(_at(_scaled_softmax_rows), x.shape[0],
                     ScaledSoftmaxArgs(x_at=address_of(x), out_at=address_of(out), n=x.shape[1], scale=scale))


def sum_rows_call(x: np.ndarray, out: np.ndarray) -> RowCall:
    """out [rows, 1] = each row of x [rows, n] summed."""
    _check_rows("sum_rows", x, out)
    if out.shape != (x.shape[0], 1):
        raise ValueError("sum_rows: out must be [rows, 1]")
    return serial_call(_at(_sum_rows), x.shape[0], SumArgs(x_at=address_of(x), out_at=address_of(out), n=x.shape[1]))


def clamp_call(x: np.ndarray, out: np.ndarray, lo: float, hi: float) -> RowCall:
    _check_rows("clamp", x, out)
    if x.shape != out.shape:
        raise ValueError("clamp: x and out differ in shape")
    return rows_call(_at(_clamp_rows), x.shape[0],
                     ClampArgs(x_at=address_of(x), out_at=address_of(out), n=x.shape[1], lo=lo, hi=hi))


def top_k_call(x: np.ndarray, out: np.ndarray) -> RowCall:
    """out (int32 [rows, k], C-contiguous) = the indices of each row's k largest values."""
    _check_rows("top_k", x)
    k = out.shape[1] if out.ndim == 2 else 0
    if not (out.dtype == np.int32 and out.flags.c_contiguous and out.shape[0] == x.shape[0] and 0 < k <= x.shape[1]):
        raise ValueError("top_k: out must be C-contiguous int32 [rows, k], k in 1..n")
    return rows_call(_at(_top_k_rows), x.shape[0], TopKArgs(x_at=address_of(x), out_at=address_of(out), n=x.shape[1], k=k))


def row_value_call(op: int, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> RowCall:
    """out = a (op) b for rows a, out [rows, n] and b [rows, 1] or [1, 1] (ADD, SUB, MUL, DIV)."""
    _check_rows("a binary op", a, b, out)
    if not (op in (ADD, SUB, MUL, DIV) and a.shape == out.shape and b.shape[1] == 1 and b.shape[0] in (1, a.shape[0])):
        raise ValueError("a binary op by row: b must be [rows, 1] or [1, 1]")
    return rows_call(_at(_row_value_rows), a.shape[0],
                     RowValueArgs(a_at=address_of(a), b_at=address_of(b), out_at=address_of(out), n=a.shape[1],
                                  b_step=1 if b.shape[0] > 1 else 0, op=op))


class PickedRows:
    """GET_ROWS of float32 rows by int32 ids the step may itself compute: a (float32 [n3, n2,
    rows, row], rows of contiguous values), ids (int32 [n2', n1, n0] with n1 = a's n2 and n2' =
    a's n3 where those are not 1), out (float32 [n2', n1, n0, row], C-contiguous); with ``add``
    (out's shape, C-contiguous), each picked row added to add's row (ADD_ID).  ``clear`` before
    the table, ``check`` after it: an id outside a's rows raises ``fail(id)``."""

    def __init__(self, a: np.ndarray, ids: np.ndarray, out: np.ndarray, fail: Callable[[int], Exception],
                 add: np.ndarray | None = None) -> None:
        n2, n1, n0 = ids.shape
        if not (a.ndim == 4 and a.dtype == f32 and a.strides[3] == 4 and all(s % 4 == 0 for s in a.strides)
                and ids.dtype == np.int32 and all(s % 4 == 0 for s in ids.strides)
                and a.shape[1] in (1, n1) and a.shape[0] in (1, n2)
                and out.dtype == f32 and out.flags.c_contiguous and out.shape == (n2, n1, n0, a.shape[3])
                and (add is None or (add.dtype == f32 and add.flags.c_contiguous and add.shape == out.shape))):
            raise ValueError("picked rows: arrays of other layouts")
        desc = [0] * P_SIZE
        desc[P_A], desc[P_A_ROWS] = address_of(a), a.shape[2]
        # a's matrices: one for every (i1, i2), or the same one where a has a single one
        desc[P_A_NB1] = a.strides[2] // 4
        desc[P_A_NB2] = a.strides[1] // 4 if a.shape[1] > 1 else 0
        desc[P_A_NB3] = a.strides[0] // 4 if a.shape[0] > 1 else 0
        desc[P_IDS], desc[P_IDS_NB0], desc[P_IDS_NB1], desc[P_IDS_NB2] = (
            address_of(ids), ids.strides[2] // 4, ids.strides[1] // 4, ids.strides[0] // 4)
        desc[P_N0], desc[P_N1], desc[P_OUT], desc[P_ROW] = n0, n1, address_of(out), a.shape[3]
        desc[P_ADD] = 0 if add is None else address_of(add)
        self.desc = np.array(desc, dtype=np.int64)
        self.fail, self.hold = fail, (a, ids, out, add)
        self.n_out = n0 * n1 * n2

    def call(self) -> RowCall:
        return rows_call(_at(_pick_rows), self.n_out, PickArgs(desc_at=address_of(self.desc)))

    def clear(self) -> None:
        self.desc[P_BAD] = 0

    def check(self) -> None:
        if self.desc[P_BAD]:
            raise self.fail(int(self.desc[P_BAD_ID]))


@part("picks", 0.6, LAYERS)
def _compile_picks() -> None:
    """GET_ROWS of float rows and TOP_K (C functions: compiled when made): every model picks its
    output rows, and the top k of its logits, with them."""
    _at(_pick_rows)
    _at(_top_k_rows)


@part("router", 0.8)
def _compile_router() -> None:
    """The rest of an experts' router (C functions: compiled when made)."""
    for kernel in (_scaled_softmax_rows, _sum_rows, _clamp_rows, _row_value_rows):
        _at(kernel)

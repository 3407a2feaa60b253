"""MUL_MAT_ID as calls of a plan's table: the experts of a step without Python between them.

Which experts a token runs is data the step itself computes (the router's top k), so a plan
cannot know the products' weights when it is made.  Four row kernels (rows.py) do what the
Python step did with numpy at every run, reading that data where the table has written it:

1. **route** (one call in the calling thread): the (token, slot) pairs grouped by expert, and
   by run of tokens where the product has runs - a counting sort, stable, so each group's pairs
   are in token order as ggml groups them; an expert id outside the weights is noted (the step
   raises once the table has run: ExpertCalls.check) and read as expert 0, so no kernel reads past
   the weights;
2. **gather**: each pair's activation row, in the groups' order, into one array that the
   activations' quantizer (activations.quantize_call) and bytes (qdot) then take as a product's;
3. **product**: the rows of every group's expert times the group's columns, each group
   computed by the format's rows as a product of its columns alone (qdot.py: the kernels for a
   batch depend on its size) - the threads divide the rows, every thread takes every group;
4. **scatter**: each pair's row of results to its place in the node, [token, slot, M].

The addresses the kernels need and the route's arrays live in arrays the step holds (a table
holds addresses only).  ``ROUTE``: one int64 array per step - the number of groups, the bad id
flag and value, then the pairs' order, the groups' first columns, their experts, their runs
(qdot's [0, columns] each) and the sort's counts (one per expert).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import carray

from .activations import activation_shapes, quantize_call
from .parts import part
from .qdot import ActivationBytesArgs, activation_bytes_at, activation_bytes_width, batch_rows, lane_sums, row_chunks
from .rows import ROWS, RowCall, address_of, row_args, row_kernel, rows_call, serial_call
from .simd import call_address, pointer

HEAD = 3  # ROUTE's first entries: groups, a bad id seen (0 or 1), that id
# pairs whose activations are gathered, quantized and scattered in the calling thread: a decoding
# step's few rows take less than waking the threads for them
SERIAL_PAIRS = 16


def route_size(n_pairs: int, n_expert: int) -> int:
    """ROUTE's length for n_pairs (token, slot) pairs over n_expert experts: never more than the
    pairs and the experts, whatever the runs (a graph from the network sizes both)."""
    return HEAD + 5 * n_pairs + 1 + n_expert + 1


def _route_rows(start, end, ids_at, ids_stride, n_tokens, n_used, n_expert, runs_at, runs_size, route_at, i8, i9,
                f0, f1):
    """The pairs grouped by (expert, run), into ROUTE (one call: start and end unused): sorted by
    expert, stably, so an expert's pairs stay in token order and so in run order - a group ends
    where the expert or the run changes."""
    n_pairs = n_tokens * n_used
    route = carray(pointer(route_at, np.int64), (HEAD + 5 * n_pairs + 1 + n_expert + 1,))
    route[0] = route[1] = route[2] = 0
    if n_pairs == 0:
        return
    ids = carray(pointer(ids_at, np.int32), ((n_tokens - 1) * ids_stride + n_used,))
    o_order = HEAD
    o_starts = o_order + n_pairs
    o_used = o_starts + n_pairs + 1
    o_runs = o_used + n_pairs
    o_counts = o_runs + 2 * n_pairs
    # (the runs' place holds each pair's expert and run until the groups are known)
    expert_of, run_of = o_runs, o_runs + n_pairs
    for j in range(n_expert + 1):
        route[o_counts + j] = 0
    run = 0
    for t in range(n_tokens):
        if runs_size > 0:
            runs = carray(pointer(runs_at, np.int64), (runs_size,))
            while run + 1 < runs_size - 1 and runs[run + 1] <= t:
                run += 1
        for u in range(n_used):
            e = np.int64(ids[t * ids_stride + u])
            if e < 0 or e >= n_expert:
                if route[1] == 0:
                    route[1] = 1
                    route[2] = e
                e = 0
            route[expert_of + t * n_used + u] = e
            route[run_of + t * n_used + u] = run
            route[o_counts + e + 1] += 1
    for j in range(n_expert):
        route[o_counts + j + 1] += route[o_counts + j]
    for p in range(n_pairs):  # stable: pairs in token order within an expert
        e = route[expert_of + p]
        route[o_order + route[o_counts + e]] = p
        route[o_counts + e] += 1
    n_groups = 0
    for c in range(n_pairs):
        p = route[o_order + c]
        q = route[o_order + c - 1] if c else p
        if c == 0 or route[expert_of + p] != route[expert_of + q] or route[run_of + p] != route[run_of + q]:
            route[o_starts + n_groups] = c
            route[o_used + n_groups] = route[expert_of + p]
            n_groups += 1
    route[o_starts + n_groups] = n_pairs
    for g in range(n_groups):  # (past the experts' and runs' last read)
        route[o_runs + 2 * g] = 0
        route[o_runs + 2 * g + 1] = route[o_starts + g + 1] - route[o_starts + g]
    route[0] = n_groups


RouteArgs = row_args(_route_rows)


def _gather_rows(start, end, x_at, slot_stride, token_stride, n_b, k, route_at, n_used, xg_at, i8, i9, f0, f1):
    """Rows start..end of the grouped activations: pair order[c]'s row of x (token t's row
    u % n_b; strides in float32 elements)."""
    order = carray(pointer(route_at + HEAD * 8, np.int64), (end,))
    xg = carray(pointer(xg_at, np.float32), (end, k))
    for c in range(start, end):
        p = order[c]
        t, u = p // n_used, p % n_used
        at = t * token_stride + (u % n_b) * slot_stride
        x = carray(pointer(x_at + at * 4, np.float32), (k,))
        for i in range(k):
            xg[c, i] = x[i]


GatherArgs = row_args(_gather_rows)


# the product's constants, an int64 array: the rows' C function (or the slot that holds it), the
# weights and the activations' and results' arrays
D_ROWS, D_BY_SLOT, D_W, D_EXPERT_BYTES, D_M, D_ROW_BYTES, D_YB, D_YB_WIDTH, D_YD, D_YD_WIDTH, D_YS, D_YS_WIDTH, \
    D_RES, D_SIZE = range(14)


def _product_rows(start, end, desc_at, route_at, n_pairs, i3, i4, i5, i6, i7, i8, i9, f0, f1):
    """Rows start..end of every group's expert times the group's columns."""
    d = carray(pointer(desc_at, np.int64), (D_SIZE,))
    route = carray(pointer(route_at, np.int64), (HEAD + 5 * n_pairs + 1,))
    o_starts = HEAD + n_pairs
    o_used = o_starts + n_pairs + 1
    o_runs = o_used + n_pairs
    rows_at = d[D_ROWS]
    if d[D_BY_SLOT]:
        rows_at = carray(pointer(rows_at, np.int64), (1,))[0]
    m_rows, yb_width, yd_width, ys_width = d[D_M], d[D_YB_WIDTH], d[D_YD_WIDTH], d[D_YS_WIDTH]
    for g in range(route[0]):
        s0, s1 = route[o_starts + g], route[o_starts + g + 1]
        call_address(rows_at, (d[D_W] + route[o_used + g] * d[D_EXPERT_BYTES], m_rows, d[D_ROW_BYTES], start, end,
                               d[D_YB] + s0 * yb_width, s1 - s0, yb_width, d[D_YD] + s0 * yd_width * 4, yd_width,
                               d[D_YS] + s0 * ys_width * 4, ys_width, d[D_RES] + s0 * m_rows * 4, m_rows,
                               route_at + (o_runs + 2 * g) * 8, 2))


ProductArgs = row_args(_product_rows)


def _scatter_rows(start, end, res_at, m, route_at, out_at, i4, i5, i6, i7, i8, i9, f0, f1):
    """Rows start..end of the grouped results to their pairs' rows of out [pairs, m]."""
    order = carray(pointer(route_at + HEAD * 8, np.int64), (end,))
    res = carray(pointer(res_at, np.float32), (end, m))
    for c in range(start, end):
        out = carray(pointer(out_at + order[c] * m * 4, np.float32), (m,))
        for i in range(m):
            out[i] = res[c, i]


ScatterArgs = row_args(_scatter_rows)


@functools.cache
def _kernels() -> tuple[int, int, int, int]:
    return row_kernel(_route_rows), row_kernel(_gather_rows), row_kernel(_product_rows), row_kernel(_scatter_rows)


@part("experts", 1.8)
def _compile_experts() -> None:
    """MUL_MAT_ID's route, gather, product and scatter (C functions: compiled when made)."""
    _kernels()


def takes(w: np.ndarray, x: np.ndarray, ids: np.ndarray, out: np.ndarray) -> bool:
    """Whether ExpertCalls takes these arrays (as its docstring says; runs are checked ones)."""
    n_tokens, n_used, m_rows = out.shape
    return (w.ndim == 3 and w.dtype == np.uint8 and w.flags.c_contiguous and w.shape[1] == m_rows
            and out.dtype == np.float32 and out.flags.c_contiguous
            and x.ndim == 3 and x.shape[0] == n_tokens and x.dtype == np.float32
            and x.strides[2] == 4 and x.strides[0] % 4 == 0 and x.strides[1] % 4 == 0
            and ids.shape == (n_tokens, n_used) and ids.dtype == np.int32 and ids.strides[1] == 4 and ids.strides[0] % 4 == 0)


class ExpertCalls:
    """One MUL_MAT_ID's calls: expert weights ``w`` (uint8 [n_expert, M, row_bytes],
    C-contiguous) of product format ``fmt`` and activation ``kind``; activations ``x`` (float32
    [n_tokens, n_b, K], strides in whole elements); ``ids`` (int32 [n_tokens, n_used], slots
    side by side); ``runs`` (checked int64, or None: one batch); ``out`` (float32 [n_tokens,
    n_used, M], C-contiguous).  :meth:`calls` takes the arrays of ``specs`` (plan.ArrayPool's,
    shared with other steps: only these calls' own values pass through them)."""

    def __init__(self, fmt: int, kind: int, w: np.ndarray, x: np.ndarray, ids: np.ndarray,
                 runs: np.ndarray | None, out: np.ndarray) -> None:
        n_expert, m_rows, _ = w.shape
        n_tokens, _, k = x.shape
        n_pairs = n_tokens * ids.shape[1]
        if not takes(w, x, ids, out) or not (runs is None or (runs.dtype == np.int64 and runs.flags.c_contiguous
                                                              and runs.size >= 2)):
            raise ValueError("MUL_MAT_ID's calls: arrays of other layouts")
        self.fmt, self.kind, self.w, self.x, self.ids, self.runs, self.out = fmt, kind, w, x, ids, runs, out
        self.route = np.zeros(route_size(n_pairs, n_expert), dtype=np.int64)
        # the grouped activations, quantized (activation_arrays), as bytes (qdot), and the grouped results
        self.specs = (((n_pairs, k), np.float32), *((shape, np.float32) for shape in activation_shapes(n_pairs, k, kind)),
                      ((n_pairs, activation_bytes_width(k, lane_sums(fmt))), np.int8), ((n_pairs, m_rows), np.float32))

    def calls(self, scratch: tuple) -> list[RowCall]:
        w, x, ids, runs, out, fmt = self.w, self.x, self.ids, self.runs, self.out, self.fmt
        (n_expert, m_rows, row_bytes), (n_tokens, n_b, k), n_used = w.shape, x.shape, ids.shape[1]
        n_pairs = n_tokens * n_used
        if tuple((a.shape, a.dtype) for a in scratch) != tuple((shape, np.dtype(t)) for shape, t in self.specs):
            raise ValueError("MUL_MAT_ID's calls: scratch of other shapes")
        xg, yq, yd, ys, yb, res = scratch
        desc = [0] * D_SIZE
        rows_at, by_slot = batch_rows(fmt)
        desc[D_ROWS], desc[D_BY_SLOT], desc[D_W], desc[D_EXPERT_BYTES] = rows_at, int(by_slot), address_of(w), m_rows * row_bytes
        desc[D_M], desc[D_ROW_BYTES] = m_rows, row_bytes
        desc[D_YB], desc[D_YB_WIDTH] = address_of(yb), yb.shape[1]
        desc[D_YD], desc[D_YD_WIDTH], desc[D_YS], desc[D_YS_WIDTH] = address_of(yd), yd.shape[1], address_of(ys), ys.shape[1]
        desc[D_RES] = address_of(res)
        self.desc = np.array(desc, dtype=np.int64)
        self.scratch = scratch
        route_at, gather_at, product_at, scatter_at = _kernels()
        route = address_of(self.route)
        threads = n_pairs > SERIAL_PAIRS
        spread = rows_call if threads else serial_call
        n_chunks, per = row_chunks(m_rows, n_tokens)
        return [
            serial_call(route_at, 1, RouteArgs(ids_at=address_of(ids), ids_stride=ids.strides[0] // 4, n_tokens=n_tokens,
                                               n_used=n_used, n_expert=n_expert,
                                               runs_at=0 if runs is None else address_of(runs),
                                               runs_size=0 if runs is None else runs.size, route_at=route)),
            spread(gather_at, n_pairs, GatherArgs(x_at=address_of(x), slot_stride=x.strides[1] // 4,
                                                  token_stride=x.strides[0] // 4, n_b=n_b, k=k, route_at=route,
                                                  n_used=n_used, xg_at=address_of(xg))),
            quantize_call(xg, self.kind, yq, yd, ys, threads=threads),
            serial_call(activation_bytes_at(), n_pairs, ActivationBytesArgs(yq_at=address_of(yq), k=k, yb_at=address_of(yb),
                                                                            width=yb.shape[1], offset=lane_sums(fmt))),
            RowCall(ROWS, product_at, m_rows, n_chunks, per,
                    *ProductArgs(desc_at=address_of(self.desc), route_at=route, n_pairs=n_pairs).packed()),
            spread(scatter_at, n_pairs, ScatterArgs(res_at=address_of(res), m=m_rows, route_at=route,
                                                    out_at=address_of(out))),
        ]

    def check(self) -> None:
        """After the calls ran: an expert id the route found outside the weights is an error."""
        if self.route[1]:
            raise ValueError(f"MUL_MAT_ID: expert id {int(self.route[2])} outside 0..{self.w.shape[0] - 1}")

"""Nodes a CPU plan runs as one step.

Products that share their activations: a plan's MUL_MATs of one input whose weights lie one
after another in memory (a layer's Q, K and V, or its gate and up, where the loader put them
so - models/loader.py's read_order).

A decoding step's products are short - SmolLM2's K and V are 69 KB each - and each call pays
a fixed cost (a parallel loop started, the threads' first reads waiting on memory) that is a
large part of so short a product.  Weights that lie one after another are one matrix to the
kernel: one call, one stream of rows through memory, and each row's dot products computed as
its own product computes them (a row's sums depend only on its bytes and its column's
format, qdot.py), so the bits are the same.  The results land in a scratch matrix and are
copied to each node's own tensor (a decoding step's rows in one call: scatter_call).  Products
with runs (a batch of several sequences' columns, ops.mul_mat) fuse when they share the runs:
each run is computed as it would be alone.

A decoding step's residual add, the norm after it and the norm's weight (ADD, RMS_NORM, MUL
of one row) run as one pass over the row (nn.add_rms_norm_mul): three calls were most of their
time.  One row's values go through the three ops in the same order either way.

The fused products run where the group's first node ran, so the others' results are written
earlier than the graph said: a group only takes a node when no node in between reads or
writes the bytes of its result (the graph allocator reuses memory between tensors whose
lives do not overlap) or writes the shared input.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
from numba import carray

from ..opdefs import NormParams, Op
from ..tensor import Tensor
from ..types import Type
from . import nn
from .buffer import CPUBuffer, tensor_view
from .ops.base import Step, reader
from .ops.matmul import _shared_activations, column_runs, quant_table_step
from .kinds import EXACT
from .parts import part
from .plan import Span, TableStep, overlap, span
from .qdot import activation_bytes_at
from .qmatmul import QuantProduct, product_format
from .activations import SERIAL_ROWS
from .rows import RowCall, address_of, c_rows, row_args, row_kernel, rows_call, serial_call
from .simd import pointer

def _runs(node: Tensor) -> Tensor | None:
    """A MUL_MAT's runs of columns (several sequences' tokens: ops.mul_mat), if any."""
    return node.src[2] if len(node.src) > 2 else None


def _fusable(node: Tensor) -> bool:
    """A MUL_MAT of a whole 2-d quantized weight (exact kernel) by 2-d activations, in host memory."""
    if node.op != Op.MUL_MAT:
        return False
    a, b = node.src[0], node.src[1]
    return (a.type in EXACT and a.ne[2] == a.ne[3] == 1 and a.is_contiguous() and isinstance(a.buffer, CPUBuffer)
            and b.ne[2] == b.ne[3] == 1 and node.is_contiguous() and isinstance(node.buffer, CPUBuffer))


def _adjacent_runs(members: list[tuple[int, Tensor]]) -> list[list[tuple[int, Tensor]]]:
    """Members (position, node) cut into runs whose weights follow one another in memory, each
    run in memory order."""
    members = sorted(members, key=lambda m: m[1].src[0].offset)
    runs: list[list[tuple[int, Tensor]]] = []
    for pos, node in members:
        w = node.src[0]
        if runs:
            prev = runs[-1][-1][1].src[0]
            if prev.offset + prev.nbytes() == w.offset:
                runs[-1].append((pos, node))
                continue
        runs.append([(pos, node)])
    return runs


def _same_kernel(run: list[tuple[int, Tensor]]) -> bool:
    """Whether the whole run's rows take the format each node's rows take alone (Q4_K repacks
    weights of a multiple of 8 rows only)."""
    qtype = run[0][1].src[0].type
    rows = sum(node.src[0].ne[1] for _, node in run)
    return all(product_format(qtype, node.src[0].ne[1]) == product_format(qtype, rows) for _, node in run)


def _safe_to_hoist(nodes: Sequence[Tensor], first: int, pos: int, node: Tensor,
                   span_of: Callable[[Tensor], Span | None]) -> bool:
    """Whether node (at ``pos``) may compute at ``first``: no node in between touches its
    result, nor writes its input.  ``span_of``: plan.span (kept per tensor by the caller)."""
    out, inputs = span_of(node), [span_of(t) for t in (node.src[1], _runs(node)) if t is not None]
    for other in nodes[first + 1:pos]:
        mine = span_of(other)
        if overlap(mine, out) or any(overlap(mine, inp) for inp in inputs):
            return False
        if any(src is not None and overlap(span_of(src), out) for src in other.src):
            return False
    return True


def product_groups(nodes: Sequence[Tensor]) -> dict[int, list[Tensor]]:
    """The groups of fused products: {position of the group's first node: its nodes in the
    order of their weights in memory}; every other member's position is left out of the plan."""
    by_input: dict[tuple, list[tuple[int, Tensor]]] = {}
    for pos, node in enumerate(nodes):
        if _fusable(node):
            a = node.src[0]
            key = (id(node.src[1]), id(_runs(node)), a.type, a.ne[0], id(a.buffer))
            by_input.setdefault(key, []).append((pos, node))
    groups: dict[int, list[Tensor]] = {}
    spans: dict[int, Span | None] = {}  # (the nodes between a group's members are checked for each)

    def span_of(t: Tensor) -> Span | None:
        s = spans.get(id(t), spans)
        if s is spans:
            s = spans[id(t)] = span(t)
        return s
    for members in by_input.values():
        for run in _adjacent_runs(members):
            while len(run) > 1:
                first = min(pos for pos, _ in run)
                keep = [(pos, n) for pos, n in run if pos == first or _safe_to_hoist(nodes, first, pos, n, span_of)]
                if len(keep) == len(run):
                    break
                # a node that cannot move splits the run where it lies in memory: keep the
                # longest adjacent stretch of those that can
                run = max(_adjacent_runs(keep), key=len)
            if len(run) > 1 and _same_kernel(run):
                groups[min(pos for pos, _ in run)] = [n for _, n in run]
    return groups


class _Scratch:
    """The one matrix a plan's fused products write into (each copies its result out before the
    next runs), as large as the largest needs: made at the plan's first run, once every step
    has said what it needs."""

    def __init__(self) -> None:
        self.size, self.data = 0, None

    def need(self, n: int) -> None:
        self.size = max(self.size, n)

    def matrix(self, rows: int, cols: int) -> np.ndarray:
        if self.data is None:
            self.data = np.empty(self.size, dtype=np.float32)
        return self.data[:rows * cols].reshape(rows, cols)


def bind_fused_products(group: list[Tensor], shared: dict) -> Step:
    """One step for the products of ``group`` (product_groups'): their weights as one matrix,
    the result copied to each node's tensor."""
    first, b = group[0].src[0], group[0].src[1]
    widths = [node.src[0].ne[1] for node in group]
    rows = np.ndarray((sum(widths), first.row_size()), dtype=np.uint8, buffer=first.buffer.data, offset=first.offset)
    product = QuantProduct(rows, first.type)
    runs_t = _runs(group[0])
    runs = column_runs(group[0], runs_t, b.ne[1]) if runs_t is not None else None
    scratch = shared.setdefault("fused products' scratch", _Scratch())
    n_cols = b.ne[1]
    scratch.need(n_cols * rows.shape[0])
    outs = [tensor_view(node).reshape(-1, m) for node, m in zip(group, widths)]
    starts = np.cumsum([0, *widths])
    if c_rows(np.float32, *outs):  # as calls of a plan's table, the results scattered by one more
        at, ends = np.array([address_of(out) for out in outs], dtype=np.int64), starts.astype(np.int64)
        table_step = quant_table_step(shared, product, group[0], b, runs_t,
                                      lambda: scratch.matrix(n_cols, rows.shape[0]),  # (sized once all are bound)
                                      lambda result: [scatter_call(result, at, ends)], hold=(outs, at, ends, scratch))
        if table_step is not None:
            return table_step
    acts = _shared_activations(shared, b, product, reader(b))
    bound: list = []

    def step() -> None:
        if not bound:  # the kernel's call and the copies, bound at the first run
            result = scratch.matrix(n_cols, rows.shape[0])
            call = lambda call=product.bound(result): call(acts(), runs() if runs is not None else None)  # noqa: E731
            parts = [(out, result[:, s:s + out.shape[1]]) for out, s in zip(outs, starts)]
            bound.extend([call, parts])
        call, parts = bound
        call()
        for out, piece in parts:
            out[...] = piece
    return step


def _scatter_rows(start, end, result_at, width, at_at, ends_at, n_outs, i5, i6, i7, i8, i9, f0, f1):
    """Rows start..end of a fused product's result [rows, width]: columns ends[i]..ends[i + 1]
    of each into the same row of the float32 matrix at address at[i] (C-contiguous, as wide as
    that)."""
    result = carray(pointer(result_at, np.float32), (end, width))
    at = carray(pointer(at_at, np.int64), (n_outs,))
    ends = carray(pointer(ends_at, np.int64), (n_outs + 1,))
    for i in range(n_outs):
        n = ends[i + 1] - ends[i]
        dst = carray(pointer(at[i], np.float32), (end, n))
        for r in range(start, end):
            for j in range(n):
                dst[r, j] = result[r, ends[i] + j]


ScatterArgs = row_args(_scatter_rows)


def scatter_call(result: np.ndarray, at: np.ndarray, ends: np.ndarray) -> RowCall:
    """A fused product's result [rows, width] into each node's tensor (at[i], as many rows,
    ends[i + 1] - ends[i] wide) as a call (rows.RowCall): one call, not a copy each (in the
    calling thread for a decoding step's row or two).  The caller holds the tensors at ``at``."""
    if not (result.ndim == 2 and c_rows(np.float32, result) and c_rows(np.int64, at, ends)
            and ends.shape == (at.size + 1,) and ends[0] == 0 and (np.diff(ends) >= 0).all()
            and ends[-1] <= result.shape[1]):
        raise ValueError("scatter: a float32 matrix, and int64 addresses and ends that cut its rows")
    return (serial_call if result.shape[0] <= SERIAL_ROWS else rows_call)(
        _scatter_at(), result.shape[0], ScatterArgs(result_at=address_of(result), width=result.shape[1],
                                                    at_at=address_of(at), ends_at=address_of(ends), n_outs=at.size))


@functools.cache
def _scatter_at() -> int:
    return row_kernel(_scatter_rows)


def _one_row(t: Tensor) -> bool:
    """An F32 tensor of one contiguous row."""
    return t.type == Type.F32 and t.is_contiguous() and t.nrows() == 1 and isinstance(t.buffer, CPUBuffer)


def norm_chains(nodes: Sequence[Tensor]) -> dict[int, list[Tensor]]:
    """The [ADD,] RMS_NORM, MUL runs of one row: {position of the first: its nodes} - a norm
    of one row whose next node multiplies it by a weight row (ne0 values), with the ADD that
    made its input just before it where there is one."""
    chains: dict[int, list[Tensor]] = {}
    for pos, norm in enumerate(nodes[:-1]):
        mul = nodes[pos + 1]
        if norm.op != Op.RMS_NORM or mul.op != Op.MUL or mul.src[0] is not norm:
            continue
        x, w = norm.src[0], mul.src[1]
        if not (_one_row(x) and _one_row(norm) and _one_row(mul) and _one_row(w) and w.ne[0] == x.ne[0]):
            continue
        add = nodes[pos - 1] if pos else None
        if (add is not None and add.op == Op.ADD and x is add
                and all(_one_row(s) and s.ne[0] == x.ne[0] for s in add.src[:2])):
            chains[pos - 1] = [add, norm, mul]
        else:
            chains[pos] = [norm, mul]
    return chains


def bind_norm_chain(chain: list[Tensor], shared: dict) -> Step:
    """One step for a norm_chains run."""
    *add, norm, mul = chain
    row = lambda t: tensor_view(t).reshape(1, -1)  # noqa: E731
    summed = row(norm.src[0])
    a, b = (row(add[0].src[0]), row(add[0].src[1])) if add else (summed, summed)
    w, normed, out, eps = tensor_view(mul.src[1]).reshape(-1), row(norm), row(mul), NormParams.of(norm).eps
    return TableStep(lambda: [nn.add_rms_norm_mul_call(a, b, bool(add), summed, eps, w, normed, out)])


def fused_plan(nodes: Sequence[Tensor], shared: dict,
               bind: Callable[[Tensor, dict], Step]) -> tuple[list[Step], list[str], list[list[Tensor]]]:
    """A plan's steps, their ops' names and the nodes each computes: each node bound by
    ``bind``, but for the product groups and norm chains above, each one step (at its first
    node's place)."""
    groups, chains = product_groups(nodes), norm_chains(nodes)  # (MUL_MATs; ADD, RMS_NORM, MUL: apart)
    fused = {id(node) for members in (*groups.values(), *chains.values()) for node in members}
    steps, ops, outputs = [], [], []
    for pos, node in enumerate(nodes):
        if pos in groups:
            steps.append(bind_fused_products(groups[pos], shared))
            ops.append(node.op.name)
            outputs.append(groups[pos])
        elif pos in chains:
            steps.append(bind_norm_chain(chains[pos], shared))
            ops.append("+".join(n.op.name for n in chains[pos]))
            outputs.append(chains[pos])
        elif id(node) not in fused:
            steps.append(bind(node, shared))
            ops.append(node.op.name)
            outputs.append([node])
    return steps, ops, outputs


@part("products", 0.6)
def _compile_products() -> None:
    """What every format's rows need around them in a plan: the activations' bytes, the fused
    products' results scattered (run_table calls every format's rows by address: the table part)."""
    out = np.zeros((1, 2), dtype=np.float32)
    scatter_call(out, np.array([out.ctypes.data], dtype=np.int64), np.array([0, 1], dtype=np.int64))
    activation_bytes_at()

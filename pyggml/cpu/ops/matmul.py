"""MUL_MAT and MUL_MAT_ID: the products, each bound as qmatmul.choose_product says."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...tensor import Tensor
from ...types import ACTIVATION_BLOCKS, Type
from ..buffer import tensor_rows, tensor_view
from ..activations import SERIAL_ROWS, activation_shapes, quantize_call, unpack, unpack_call
from ..plan import ArrayPool, TableStep
from ..experts import ExpertCalls, takes
from ..kinds import EXACT
from ..qdot import activation_bytes_width, lane_sums, product_calls
from ..qmatmul import Layout, ProductStep, QuantProduct, choose_product, frozen, whole
from ..rows import RowCall

from .base import Read, Step, _shared_value, f32, reader


def float_rows(t: Tensor) -> np.ndarray:
    """An F32 tensor's values as rows [rows, ne0] (a view when its rows lie one after another,
    else an empty array: quant_table_step then declines)."""
    if t.type != Type.F32 or not t.is_contiguous():
        return np.empty((0, max(t.ne[0], 1)), dtype=f32)
    return tensor_view(t).reshape(-1, t.ne[0])


def in_blocks(t: Tensor) -> bool:
    """Whether t holds activations already in a product's form (ops.mul_mat)."""
    return t.type in ACTIVATION_BLOCKS


def block_rows(t: Tensor) -> np.ndarray:
    """Activations in blocks (in_blocks) as rows [rows, row_bytes] when their rows lie one after
    another, else an empty array."""
    if not in_blocks(t) or not t.is_contiguous():
        return np.empty((0, 0), dtype=np.uint8)
    return tensor_rows(t).reshape(-1, t.row_size())


def _shared_activations(shared: dict, b: Tensor, product: QuantProduct, x: Read) -> Callable[[], object]:
    """The activations of b for ``product``, converted once per step for every product of the
    plan that reads b in the same form: taken from b's blocks where b already is in it."""
    width = b.ne[0]
    if in_blocks(b) and product.exact:
        rows, kind = tensor_rows(b), product.kind
        return _shared_value(shared, ("activations", id(b), product.activation_key),
                             lambda: unpack(rows.reshape(-1, rows.shape[-1]), width, kind))
    return _shared_value(shared, ("activations", id(b), product.activation_key),
                         lambda: product.activations(x().reshape(-1, width)))


def _checked_runs(node: Tensor, t: Tensor, n_cols: int, shared: dict) -> tuple[np.ndarray, Callable[[], None] | None]:
    """MUL_MAT's runs (column_runs') as int64 in an array of the plan's that table calls read,
    and what fills and checks it before they run (for the first step of the plan that reads t;
    the others None)."""
    key = ("checked runs", id(t), n_cols)
    if key in shared:
        return shared[key], None
    runs = column_runs(node, t, n_cols)
    checked = shared[key] = np.empty(t.nelements(), dtype=np.int64)

    def prepare() -> None:
        checked[...] = runs()
    return checked, prepare


def quant_table_step(shared: dict, product: QuantProduct, node: Tensor, b: Tensor, runs_t: Tensor | None,
                     out: Callable[[], np.ndarray], then: Callable[[np.ndarray], list[RowCall]] | None = None,
                     hold: tuple = ()) -> TableStep | None:
    """A product of exact weights (``product``) with the F32 rows of b into ``out()`` (made when
    the plan's tables are, C-contiguous [columns, M] or wider), as calls of a plan's table: b
    quantized by the first product of the plan that reads it in this form, into arrays of the
    plan's (plan.ArrayPool) that the others read; the activations' bytes; the rows; then
    ``then(out)``'s calls.  None where the calls cannot take it (other weights, b not rows one
    after another, runs computed in the graph)."""
    x, blocks = float_rows(b), block_rows(b)
    n_cols, k = (blocks.shape[0], b.ne[0]) if in_blocks(b) else x.shape
    if not (product.exact and product.m_rows > 0 and n_cols > 0 and product.qtype.row_size(k) == product.w.shape[1]):
        return None
    pool = shared.setdefault("activation pool", ArrayPool())
    key = ("table activations", id(b), product.activation_key)
    quantizes = key not in shared  # (binding follows the plan's order)
    shared[key] = True
    acts = pool.use(key, tuple((shape, f32) for shape in activation_shapes(n_cols, k, product.kind)))
    yb = pool.use(object(), (((n_cols, activation_bytes_width(k, lane_sums(product.fmt))), np.int8),))
    runs, prepare = _checked_runs(node, runs_t, n_cols, shared) if runs_t is not None else (whole(n_cols), None)

    def calls() -> list[RowCall]:
        (yq, yd, ys), (y_bytes,), result = acts(), yb(), out()
        convert = unpack_call(blocks, product.kind, yq, yd, ys, threads=n_cols > SERIAL_ROWS) if in_blocks(b) else \
            quantize_call(x, product.kind, yq, yd, ys, threads=n_cols > SERIAL_ROWS)
        quantize = [convert] if quantizes else []
        return [*quantize, *product_calls(product.fmt, product.w, yq, yd, ys, y_bytes, result, runs),
                *(then(result) if then is not None else [])]
    return TableStep(calls, prepare, reads=(runs_t,) if runs_t is not None else (), hold=(pool, x, product, hold))


def column_runs(node: Tensor, t: Tensor, n_cols: int) -> Callable[[], np.ndarray]:
    """MUL_MAT's / MUL_MAT_ID's runs (ops.mul_mat) as int64, checked at every step: they are data
    (over RPC, from the network) - from 0 to the number of columns, never decreasing."""
    view = tensor_view(t).reshape(-1)

    def runs() -> np.ndarray:
        r = view.astype(np.int64)
        if r[0] != 0 or r[-1] != n_cols or (np.diff(r) < 0).any():
            raise ValueError(f"{node.op.name}: runs {r[:8].tolist()}{'...' if r.size > 8 else ''} must rise from 0 "
                             f"to {n_cols} (the columns)")
        return r
    return runs


def bind_mul_mat(node: Tensor, shared: dict) -> Step:
    a, b = node.src[0], node.src[1]
    out = tensor_view(node)  # [b3, b2, N, M]
    x = reader(b)            # [b3, b2, N, K]
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    runs_t = node.src[2] if len(node.src) > 2 else None
    runs = column_runs(node, runs_t, b.ne[1]) if runs_t is not None else None
    w = tensor_rows(a) if a.type.has_vec_dot else None  # [a3, a2, M, row_bytes]
    one_matrix = a.ne[2] == 1 and a.ne[3] == 1 and (w is None or w[0, 0].flags.c_contiguous)
    x_rows = (block_rows(b) if in_blocks(b) else float_rows(b)).shape[0]
    layout = Layout(one_matrix, out.flags.c_contiguous, x_rows == b.ne[1] * b.ne[2] * b.ne[3])
    plan = choose_product(a.type, a.ne[1], layout, b.ne[1], runs is not None)
    if plan.step == ProductStep.TABLE:
        out_rows = out.reshape(-1, a.ne[1])
        table_step = quant_table_step(shared, QuantProduct(w[0, 0], a.type), node, b, runs_t, lambda: out_rows)
        if table_step is not None:
            return table_step
    if plan.step in (ProductStep.TABLE, ProductStep.CALL):
        product = QuantProduct(w[0, 0], a.type)
        acts = _shared_activations(shared, b, product, x)
        flat = out.reshape(-1, a.ne[1])
        call = product.bound(flat) or (lambda acts, runs=None: product(acts, flat, runs))
        if runs is not None:
            return lambda: call(acts(), runs())
        return lambda: call(acts())
    if plan.step == ProductStep.CALL_COPY:
        product = QuantProduct(w[0, 0], a.type)
        acts = _shared_activations(shared, b, product, x)

        def step_copy() -> None:
            res = np.empty((out.size // a.ne[1], a.ne[1]), dtype=f32)
            product(acts(), res, runs() if runs is not None else None)
            out[...] = res.reshape(out.shape)
        return step_copy
    if plan.step == ProductStep.PER_MATRIX:
        slices = {(i3, i2): w[i3 // r3, i2 // r2] for i3 in range(b.ne[3]) for i2 in range(b.ne[2])}
        # a matrix whose rows lie apart is gathered at every step: a copy made now would go stale
        products = {key: QuantProduct(rows, a.type) for key, rows in slices.items() if rows.flags.c_contiguous}

        b_blocks = tensor_rows(b) if in_blocks(b) else None  # [b3, b2, N, row_bytes]

        def step_per_matrix() -> None:
            xv = x()
            for (i3, i2), rows in slices.items():
                product = products.get((i3, i2)) or QuantProduct(np.ascontiguousarray(rows), a.type)
                res = np.empty(out.shape[2:], dtype=f32)
                if b_blocks is not None and product.exact:  # (blocks already: as they are)
                    acts = unpack(b_blocks[i3, i2], b.ne[0], product.kind)
                else:
                    acts = product.activations(xv[i3, i2])
                product(acts, res, runs() if runs is not None else None)
                out[i3, i2] = res
        return step_per_matrix
    wa = reader(a)            # [a3, a2, M, K]
    if plan.step == ProductStep.FLOAT_RUNS:  # (b is 2-D) each run its own product: BLAS's kernels depend on the columns too
        def step_runs() -> None:
            xv, av, r = x()[0, 0], wa()[0, 0], runs()
            for r0, r1 in zip(r[:-1], r[1:]):
                out[0, 0, r0:r1] = np.matmul(xv[r0:r1], av.T)
        return step_runs

    def step_float() -> None:
        xv, av = x(), wa()
        a3, a2, m, k = av.shape
        xs = xv.reshape(a3, r3, a2, r2, xv.shape[2], k)
        res = np.matmul(xs, av.reshape(a3, 1, a2, 1, m, k).swapaxes(-1, -2))
        out[...] = res.reshape(out.shape)
    return step_float


def bind_mul_mat_id(node: Tensor, shared: dict) -> Step:
    """Tokens grouped by expert: each expert's rows are read once per batch, for all the
    tokens routed to it (as ggml groups them).  With the exact block products, as calls of the
    plan's table (experts.py: the grouping in compiled code, each group a product of its
    columns alone); else in Python, a product per group.  With runs of tokens, a group is an
    expert's tokens of one run (each computed as that run alone would have it)."""
    a, b, ids = node.src[:3]
    runs_t = node.src[3] if len(node.src) > 3 else None
    index = tensor_view(ids)[0, 0]           # [n_tokens, n_used]
    out = tensor_view(node)[0]               # [n_tokens, n_used, M]
    n_expert, n_b, m_rows = a.ne[2], b.ne[1], a.ne[1]
    rows = tensor_rows(a)[0] if a.type.has_vec_dot else None  # [n_expert, M, row_bytes]
    x_rows = tensor_view(b)[0] if b.type == Type.F32 else None  # [n_tokens, n_b, K]
    if rows is not None and a.type in EXACT and x_rows is not None and takes(rows, x_rows, index, out):
        product = QuantProduct(rows[0], a.type)
        runs, prepare = _checked_runs(node, runs_t, b.ne[2], shared) if runs_t is not None else (None, None)
        calls = ExpertCalls(product.fmt, product.kind, frozen(rows), x_rows, index, runs, out)
        scratch = shared.setdefault("activation pool", ArrayPool()).use(object(), calls.specs)
        return TableStep(lambda: calls.calls(scratch()), prepare, reads=(runs_t,) if runs_t is not None else (),
                         hold=(calls,), check=calls.check)
    runs = column_runs(node, runs_t, b.ne[2]) if runs_t is not None else None
    x = reader(b)                            # [1, n_tokens, n_b, K]
    experts = reader(a) if rows is None else None

    def step() -> None:
        idx = index.astype(np.int64)
        bad = idx[(idx < 0) | (idx >= n_expert)]
        if bad.size:
            raise ValueError(f"MUL_MAT_ID: expert id {int(bad[0])} outside 0..{n_expert - 1}")
        xv = x()[0]
        # a group: the routed (token, slot) pairs of one expert (and one run of tokens), in token order
        run_of = np.zeros(idx.shape, np.int64) if runs is None else \
            np.broadcast_to((np.searchsorted(runs(), np.arange(idx.shape[0]), side="right") - 1)[:, None], idx.shape)
        key = (idx * (run_of.max() + 1) + run_of).reshape(-1)
        for group in np.unique(key):
            t_sel, u_sel = np.nonzero(key.reshape(idx.shape) == group)
            e = idx[t_sel[0], u_sel[0]]
            cols = np.ascontiguousarray(xv[t_sel, u_sel % n_b])
            if rows is not None:
                product = QuantProduct(np.ascontiguousarray(rows[e]), a.type)
                res = np.empty((len(cols), m_rows), dtype=f32)
                product(product.activations(cols), res)
            else:
                res = cols @ experts()[0, e].T
            out[t_sel, u_sel] = res
    return step

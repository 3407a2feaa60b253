"""The CPU's choice of a product's kernel and step (qmatmul.choose_product): every case of its
decision table, and the binder following it."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import pyggml as pg
from pyggml import ops
from pyggml.cpu.kinds import EXACT, Fmt
from pyggml.cpu.plan import TableStep
from pyggml.cpu.qmatmul import FUSED_MAX_COLS, Layout, ProductKernel, ProductStep, choose_product
from pyggml.cpu import OP_TABLE

LAYOUTS = [Layout(*flags) for flags in itertools.product((True, False), repeat=3)]


def expected(qtype: pg.Type, m_rows: int, layout: Layout, n_cols: int, runs: bool):
    """The docstring's tables, restated row by row."""
    if qtype in (pg.Type.F32, pg.Type.BF16, pg.Type.F64, pg.Type.I8, pg.Type.I16, pg.Type.I32, pg.Type.I64):
        return (ProductStep.FLOAT_RUNS if runs else ProductStep.FLOAT), ProductKernel.BLAS, None
    if qtype in EXACT:
        kernel = ProductKernel.EXACT
        fmt = Fmt.Q4_K_X8 if qtype == pg.Type.Q4_K and m_rows % 8 == 0 else EXACT[qtype]
    else:
        kernel, fmt = (ProductKernel.FUSED if n_cols <= FUSED_MAX_COLS else ProductKernel.DECODED_BLAS), None
    if not layout.one_matrix:
        step = ProductStep.PER_MATRIX
    elif kernel == ProductKernel.EXACT and layout.out_rows and layout.x_rows and m_rows and n_cols:
        step = ProductStep.TABLE
    elif layout.out_rows:
        step = ProductStep.CALL
    else:
        step = ProductStep.CALL_COPY
    return step, kernel, fmt


def test_every_case_of_the_table():
    seen = set()
    for qtype, m_rows, layout, n_cols, runs in itertools.product(
            pg.Type, (8, 12), LAYOUTS, (1, FUSED_MAX_COLS, FUSED_MAX_COLS + 1), (False, True)):
        plan = choose_product(qtype, m_rows, layout, n_cols, runs)
        assert (plan.step, plan.kernel, plan.fmt) == expected(qtype, m_rows, layout, n_cols, runs), \
            (qtype, m_rows, layout, n_cols, runs)
        seen.add((plan.step, plan.kernel))
    assert {s for s, _ in seen} == set(ProductStep) and {k for _, k in seen} == set(ProductKernel)


def test_the_docstring_names_every_step_and_kernel():
    doc = choose_product.__doc__
    for name in [*ProductStep.__members__, *ProductKernel.__members__]:
        assert f" {name} " in doc, name


def _bound(a_type: pg.Type, n_cols: int):
    """bind_mul_mat's step for weights of a_type [K=256, M=8] and n_cols F32 columns."""
    rng = np.random.default_rng(0)
    k, m = 256, 8
    w = pg.new_tensor(a_type, (k, m))
    x = pg.new_tensor(pg.Type.F32, (k, n_cols))
    g = pg.build_forward(ops.mul_mat(w, x))
    buf = pg.alloc_tensors([w, x], pg.cpu_device().get_buffer_type())
    values = rng.standard_normal((m, k)).astype(np.float32)
    pg.tensor_set(w, pg.quants.quantize(values, a_type) if a_type.is_quantized else values.astype(a_type.np_dtype))
    pg.alloc_graph(g, pg.cpu_device().get_buffer_type())
    node = next(n for n in g.nodes if n.op == pg.Op.MUL_MAT)
    return OP_TABLE[pg.Op.MUL_MAT](node, {}), buf


@pytest.mark.parametrize("a_type,n_cols,step", [
    (pg.Type.Q8_0, 4, ProductStep.TABLE),
    (pg.Type.Q4_K, 9, ProductStep.TABLE),
    (pg.Type.F16, 4, ProductStep.CALL),
    (pg.Type.MXFP4, 4, ProductStep.TABLE),
])
def test_the_binder_follows_the_choice(a_type, n_cols, step):
    bound, _ = _bound(a_type, n_cols)
    assert isinstance(bound, TableStep) == (step == ProductStep.TABLE)

"""An experts' router as row kernels of the plan's table (pyggml/cpu/router.py): SOFT_MAX,
TOP_K, GET_ROWS of the chosen probabilities, SUM_ROWS, CLAMP and DIV, and each expert's output
times its weight - the whole router one table, each op's values those of the numpy step it
replaced (and of ggml's arithmetic)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import pyggml as pg
from pyggml import Type, ops
from pyggml.cpu import nn
from pyggml.cpu.plan import TableStep

N_EXPERT, N_USED, N_TOKENS, WIDTH = 12, 4, 5, 24


def router_graph():
    """qwen3moe's router (models/blocks.py), normalized weights times the experts' outputs."""
    logits = pg.new_tensor(Type.F32, (N_EXPERT, N_TOKENS), "logits").set_input()
    outs = pg.new_tensor(Type.F32, (WIDTH, N_USED, N_TOKENS), "expert_outs").set_input()
    probs = ops.soft_max(logits)
    selected = ops.top_k(probs, N_USED)
    weights = ops.get_rows(ops.reshape(probs, 1, N_EXPERT, N_TOKENS), selected)   # [1, n_used, n_tokens]
    flat = ops.reshape(weights, N_USED, N_TOKENS)
    total = ops.clamp(ops.sum_rows(flat), 6.103515625e-5, float("inf"))
    normed = ops.div(flat, total)
    weighted = ops.mul(outs, ops.reshape(normed, 1, N_USED, N_TOKENS))
    return logits, outs, (probs, selected, normed, weighted)


def by_numpy(logits: np.ndarray, outs: np.ndarray) -> tuple[np.ndarray, ...]:
    """The numpy steps the kernels replaced, as they computed."""
    probs = logits.copy()
    nn.softmax_rows(probs)
    selected = np.empty((N_TOKENS, N_USED), dtype=np.int64)
    nn.top_k_rows(probs, N_USED, selected)
    weights = np.take_along_axis(probs, selected, axis=1)
    total = np.clip(np.array([[functools.reduce(lambda s, v: s + np.float64(v), row, 0.0)] for row in weights]
                             ).astype(np.float32), np.float32(6.103515625e-5), np.float32(np.inf))
    normed = weights / total
    return probs, selected.astype(np.int32), normed, outs * normed[:, :, None]


def test_a_router_is_one_table_with_the_numpy_steps_values():
    logits, outs, results = router_graph()
    graph = pg.build_forward(results[-1])
    for t in results:
        graph.build_forward_expand(t.set_output())
    backend = pg.cpu_device().init_backend()
    plans = []
    create = backend.graph_plan_create
    backend.graph_plan_create = lambda g: plans.append(create(g)) or plans[-1]
    sched = pg.Scheduler([backend])
    sched.alloc_graph(graph)
    rng = np.random.default_rng(3)
    for _ in range(3):
        lv = rng.standard_normal((N_TOKENS, N_EXPERT)).astype(np.float32)
        lv[0, 3] = lv[0, 7]  # a tie: the lower index first
        ov = rng.standard_normal((N_TOKENS, N_USED, WIDTH)).astype(np.float32)
        pg.tensor_set(logits, lv)
        pg.tensor_set(outs, ov)
        sched.graph_compute(graph)
        for t, want in zip(results, by_numpy(lv, ov)):
            got = pg.tensor_array(t).reshape(want.shape)
            np.testing.assert_array_equal(got.view(np.uint32) if got.dtype == np.float32 else got,
                                          want.view(np.uint32) if want.dtype == np.float32 else want, err_msg=t.name)
    steps = [s for p in plans for s in p.steps]
    assert steps and all(isinstance(s, TableStep) for s in steps)
    assert all(len(p.runs) == 1 for p in plans)


@pytest.mark.parametrize("bad", [N_EXPERT, -3])
def test_float_rows_picked_by_an_id_outside_them_are_an_error_after_the_table(bad):
    """GET_ROWS of float rows by ids the step computes: a bad id reads nothing out of bounds
    (its row is zeros) and the step raises once the table ran; the plan then runs on."""
    probs = pg.new_tensor(Type.F32, (1, N_EXPERT, 2), "probs").set_input()
    ids = pg.new_tensor(Type.I32, (N_USED, 2), "ids").set_input()
    out = ops.get_rows(probs, ids)
    graph = pg.build_forward(out)
    sched = pg.Scheduler([pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    pv = np.arange(2 * N_EXPERT, dtype=np.float32).reshape(2, N_EXPERT, 1)
    pg.tensor_set(probs, pv)
    pg.tensor_set(ids, np.array([[0, 1, 2, 3], [4, bad, 6, 7]], np.int32))
    with pytest.raises(IndexError, match=f"GET_ROWS: index out of range \\[0, {N_EXPERT}\\) in ids"):
        sched.graph_compute(graph)
    good = np.array([[11, 0, 5, 5], [1, 2, 3, 4]], np.int32)
    pg.tensor_set(ids, good)
    sched.graph_compute(graph)
    got = pg.tensor_array(out).reshape(2, N_USED)
    np.testing.assert_array_equal(got, np.take_along_axis(pv[:, :, 0], good, axis=1))


def test_sum_rows_adds_in_double_one_value_after_the_other():
    """ggml_vec_sum_f32's order (numpy's pairwise sum differs past 8 values): values whose
    double sum depends on it."""
    row = np.array([1e8, 1.0, -1e8] + [3e-9] * 13, dtype=np.float32)
    x = pg.new_tensor(Type.F32, (row.size, 1), "x").set_input()
    out = ops.sum_rows(x)
    graph = pg.build_forward(out)
    sched = pg.Scheduler([pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    pg.tensor_set(x, row[None])
    sched.graph_compute(graph)
    want = np.float32(functools.reduce(lambda s, v: s + np.float64(v), row, 0.0))
    assert pg.tensor_array(out).reshape(()) == want


def test_clamp_rows_as_numpys_clip():
    xv = np.array([[-2.5, -1.0, 0.0, 0.25, 1.0, 7.0, -np.inf, np.inf]], dtype=np.float32)
    x = pg.new_tensor(Type.F32, (xv.shape[1], 1), "x").set_input()
    out = ops.clamp(x, -1.0, 0.5)
    graph = pg.build_forward(out)
    sched = pg.Scheduler([pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    pg.tensor_set(x, xv)
    sched.graph_compute(graph)
    np.testing.assert_array_equal(pg.tensor_array(out).reshape(xv.shape), np.clip(xv, np.float32(-1), np.float32(0.5)))


def test_each_chosen_experts_bias_is_added_by_its_id():
    """ADD_ID (gpt-oss's expert biases) as picked rows added: a[:, u, t] + b[:, ids[u, t]]; an id
    outside the experts raises after the table, and the plan runs on."""
    n, n_expert = 40, 5
    a = pg.new_tensor(Type.F32, (n, N_USED, N_TOKENS), "a").set_input()
    b = pg.new_tensor(Type.F32, (n, n_expert), "b").set_input()
    ids = pg.new_tensor(Type.I32, (N_USED, N_TOKENS), "ids").set_input()
    out = ops.add_id(a, b, ids)
    graph = pg.build_forward(out)
    sched = pg.Scheduler([pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    rng = np.random.default_rng(8)
    av = rng.standard_normal((N_TOKENS, N_USED, n)).astype(np.float32)
    bv = rng.standard_normal((n_expert, n)).astype(np.float32)
    pg.tensor_set(a, av)
    pg.tensor_set(b, bv)
    bad = rng.integers(0, n_expert, (N_TOKENS, N_USED)).astype(np.int32)
    bad[2, 1] = n_expert
    pg.tensor_set(ids, bad)
    with pytest.raises(ValueError, match=f"ADD_ID: id {n_expert} outside 0..{n_expert - 1}"):
        sched.graph_compute(graph)
    good = rng.integers(0, n_expert, (N_TOKENS, N_USED)).astype(np.int32)
    pg.tensor_set(ids, good)
    sched.graph_compute(graph)
    np.testing.assert_array_equal(pg.tensor_array(out).reshape(av.shape), av + bv[good])

"""The CPU plans' fused products (pyggml/cpu/fusion.py) and the weights' order in memory
(models/loader.py's read_order): the same bits as op by op, fused only where it is safe."""
from __future__ import annotations

import numpy as np
import pytest

import pyggml as pg
from pyggml import Type, ops
from pyggml.cpu.fusion import norm_chains, product_groups
from pyggml.opdefs import VIEW_OPS

from tests.test_quants import random_blocks

K = 256


def _weights(buft, qtype: Type, rows: list[int]) -> list[pg.Tensor]:
    """Weight matrices of these row counts, one after another in one buffer, random blocks."""
    ws = [pg.new_tensor(qtype, (K, m), f"w{i}") for i, m in enumerate(rows)]
    pg.alloc_tensors(ws, buft)
    for i, w in enumerate(ws):
        pg.tensor_set(w, random_blocks(qtype, w.ne[1], K // qtype.block_size, seed=i))
    return ws


def _plan_and_op_by_op(cpu, graph: pg.Graph, outs: list[pg.Tensor]) -> tuple[list[np.ndarray], list[np.ndarray], object]:
    plan = cpu.graph_plan_create(graph)
    cpu.graph_plan_compute(plan)
    planned = [pg.tensor_array(t).copy() for t in outs]
    for t in outs:
        pg.tensor_set(t, np.full(t.ne[::-1], np.nan, dtype=np.float32))
    cpu.graph_compute(graph)
    return planned, [pg.tensor_array(t).copy() for t in outs], plan


def _nodes(graph: pg.Graph) -> list[pg.Tensor]:
    return [n for n in graph.nodes if n.op not in VIEW_OPS]


@pytest.mark.parametrize("qtype", [Type.Q4_0, Type.Q8_0, Type.Q4_K])
@pytest.mark.parametrize("n_cols", [1, 3, 9])
def test_products_of_one_input_with_adjacent_weights_run_as_one_with_the_same_bits(cpu, qtype, n_cols):
    buft = cpu.get_device().get_buffer_type()
    ws = _weights(buft, qtype, [64, 32, 16])
    x = pg.new_tensor(Type.F32, (K, n_cols), "x")
    ys = [ops.mul_mat(w, x) for w in ws]
    graph = pg.Graph()
    for y in ys:
        graph.build_forward_expand(y)
    pg.alloc_graph(graph, buft)
    pg.tensor_set(x, np.random.default_rng(n_cols).standard_normal((n_cols, K)).astype(np.float32))
    groups = product_groups(_nodes(graph))
    assert [[n.name for n in g] for g in groups.values()] == [[y.name for y in ys]]
    planned, one_by_one, plan = _plan_and_op_by_op(cpu, graph, ys)
    assert len(plan.steps) == 1
    for a, b in zip(planned, one_by_one):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("runs", [[0, 3, 11, 12], [0, 1, 2]])
def test_products_of_several_sequences_columns_run_as_one_with_the_same_bits(cpu, runs):
    """With runs (each sequence's columns multiplied as they would be alone), as a server's
    batch of sequences takes them."""
    buft = cpu.get_device().get_buffer_type()
    ws = _weights(buft, Type.Q4_K, [64, 32])
    n_cols = runs[-1]
    x = pg.new_tensor(Type.F32, (K, n_cols), "x")
    r = pg.new_tensor(Type.I32, (len(runs),), "runs")
    ys = [ops.mul_mat(w, x, r) for w in ws]
    graph = pg.Graph()
    for y in ys:
        graph.build_forward_expand(y)
    pg.alloc_graph(graph, buft)
    pg.tensor_set(x, np.random.default_rng(n_cols).standard_normal((n_cols, K)).astype(np.float32))
    pg.tensor_set(r, np.array(runs, dtype=np.int32))
    assert len(product_groups(_nodes(graph))) == 1
    planned, one_by_one, plan = _plan_and_op_by_op(cpu, graph, ys)
    assert len(plan.steps) == 1
    for a, b in zip(planned, one_by_one):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_weights_apart_or_of_other_types_are_not_fused(cpu):
    buft = cpu.get_device().get_buffer_type()
    (w0,), (w1,) = _weights(buft, Type.Q4_0, [32]), _weights(buft, Type.Q4_0, [32])  # two buffers
    w2, w3 = _weights(buft, Type.Q4_0, [32]) + _weights(buft, Type.Q8_0, [32])
    w4, w5 = _weights(buft, Type.Q4_K, [16, 12])  # repacked alone (16 rows), not together (28)
    x = pg.new_tensor(Type.F32, (K, 1), "x")
    graph = pg.Graph()
    for w in (w0, w1, w2, w3, w4, w5):
        graph.build_forward_expand(ops.mul_mat(w, x))
    pg.alloc_graph(graph, buft)
    assert product_groups(_nodes(graph)) == {}


def test_a_product_whose_result_overlaps_a_tensor_read_in_between_is_not_moved(cpu):
    """y1 = w0 x, s = 2 y1, y2 = w1 x with y2 in y1's bytes (as the graph allocator may place
    it once s has read y1): running y2 at y1's place would overwrite y1 before s reads it."""
    buft = cpu.get_device().get_buffer_type()
    w0, w1 = _weights(buft, Type.Q4_0, [32, 32])
    x = pg.new_tensor(Type.F32, (K, 1), "x")
    y1 = ops.mul_mat(w0, x)
    s = ops.scale(y1, 2.0)
    y2 = ops.mul_mat(w1, x)
    graph = pg.Graph()
    graph.build_forward_expand(s)
    graph.build_forward_expand(y2)
    assert [n.op.name for n in _nodes(graph)] == ["MUL_MAT", "SCALE", "MUL_MAT"]
    pg.alloc_tensors([x, y1, s], buft)
    y2.buffer, y2.offset = y1.buffer, y1.offset  # y1's bytes, free once s has read them
    pg.tensor_set(x, np.random.default_rng(0).standard_normal((1, K)).astype(np.float32))
    assert product_groups(_nodes(graph)) == {}
    planned, one_by_one, _ = _plan_and_op_by_op(cpu, graph, [s, y2])
    for a, b in zip(planned, one_by_one):
        np.testing.assert_array_equal(a, b)
    # placed apart, the same products are fused
    pg.alloc_tensors([y2], buft)
    assert len(product_groups(_nodes(graph))) == 1


def test_a_layers_weights_lie_in_the_order_its_graph_reads_them(smollm2_path):
    m = pg.Model(smollm2_path, n_ctx=64, use_mmap=False, progress=False)
    w = m.model.weights
    q, k, v = (w[f"blk.0.attn_{x}.weight"] for x in "qkv")
    gate, up = w["blk.0.ffn_gate.weight"], w["blk.0.ffn_up.weight"]
    assert q.buffer is k.buffer is v.buffer is gate.buffer
    assert k.offset == q.offset + q.nbytes() and v.offset == k.offset + k.nbytes()
    assert up.offset == gate.offset + gate.nbytes()
    mapped = pg.Model(smollm2_path, n_ctx=64, use_mmap=True, progress=False)
    assert np.shares_memory(mapped.model.weights["blk.0.attn_q.weight"].buffer.data, mapped.model.gguf.map)
    assert not np.shares_memory(q.buffer.data, mapped.model.gguf.map)
    # one decoding step: each layer's Q, K, V products one step, its gate and up another
    plans = []
    cpu = m.context.backends[-1]
    create = cpu.graph_plan_create

    def spy(graph):
        plans.append(create(graph))
        return plans[-1]
    cpu.graph_plan_create = spy
    ids = m.tokenize("The capital of France is")
    got = [m.context.decode(ids).copy(), m.context.decode([ids[-1]]).copy()]
    expected = [mapped.context.decode(ids).copy(), mapped.context.decode([ids[-1]]).copy()]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    n_layer = m.model.hp.n_layer
    decode = plans[-1]
    assert decode.ops.count("MUL_MAT") == n_layer * 4 + 1  # qkv, output, gate+up, down; the head


@pytest.mark.parametrize("with_add", [True, False])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_rows_add_norm_and_weight_run_as_one_step_with_the_same_bits(cpu, with_add, rows):
    """[ADD,] RMS_NORM, MUL by a weight row: one step for one row (a decoding step's), the ops
    apart for more."""
    buft = cpu.get_device().get_buffer_type()
    n = 576
    a, b, w = (pg.new_tensor(Type.F32, (n, rows), "a"), pg.new_tensor(Type.F32, (n, rows), "b"),
               pg.new_tensor(Type.F32, (n,), "w"))
    x = ops.add(a, b) if with_add else a
    normed = ops.rms_norm(x, 1e-5)
    out = ops.mul(normed, w)
    graph = pg.build_forward(out)
    pg.alloc_graph(graph, buft)
    rng = np.random.default_rng(rows)
    for t in (a, b, w) if with_add else (a, w):
        pg.tensor_set(t, (rng.standard_normal(t.ne[::-1]) * 3).astype(np.float32))
    chains = norm_chains(_nodes(graph))
    assert [[n.op.name for n in c] for c in chains.values()] == \
        ([["ADD", "RMS_NORM", "MUL"] if with_add else ["RMS_NORM", "MUL"]] if rows == 1 else [])
    planned, one_by_one, plan = _plan_and_op_by_op(cpu, graph, [x, normed, out] if with_add else [normed, out])
    assert len(plan.steps) == (1 if rows == 1 else len(_nodes(graph)))
    for p, o in zip(planned, one_by_one):
        assert np.isfinite(o).all()
        np.testing.assert_array_equal(p.view(np.uint32), o.view(np.uint32))


def test_the_read_order_keeps_a_layers_matrices_together():
    from pyggml.models.loader import read_order
    names = ["output.weight", "blk.1.attn_q.weight", "blk.0.ffn_up.weight", "blk.0.attn_v.bias", "blk.0.attn_k.weight",
             "blk.0.attn_q.bias", "blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_gate.weight",
             "blk.0.attn_norm.weight", "blk.0.some_new_kind.weight", "token_embd.weight"]
    assert sorted(names, key=read_order) == [
        "token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
        "blk.0.attn_v.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.some_new_kind.weight",
        "blk.0.attn_q.bias", "blk.0.attn_v.bias", "blk.1.attn_q.weight", "output.weight"]

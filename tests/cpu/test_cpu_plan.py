"""CPU plans as tables of row-kernel calls (pyggml/cpu/plan.py): a decoding step runs as one
compiled call, with the bits of the op-by-op path and of the plan's
steps run one at a time (what the profiler does); a step whose prepare reads what an earlier
step of its table writes starts a new table."""
from __future__ import annotations

import numpy as np
import pytest

import pyggml as pg
from pyggml import Type, ops
from pyggml.cpu.device import OpProfile
from pyggml.cpu.plan import TableRun, TableStep, plan_runs
from pyggml.cpu.rows import run_calls


def _cpu_of(model: pg.Model):
    return model.context.backends[-1]


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_a_decoding_step_is_one_table_with_the_bits_of_op_by_op(alias, smollm2_path, gemma3_path):
    path = smollm2_path if alias == "smollm2" else gemma3_path
    planned, by_op = (pg.Model(path, n_ctx=128, progress=False) for _ in range(2))
    plans = []
    cpu = _cpu_of(planned)
    create = cpu.graph_plan_create

    def spy(graph):
        plans.append(create(graph))
        return plans[-1]
    cpu.graph_plan_create = spy
    op_cpu = _cpu_of(by_op)
    op_cpu.graph_plan_compute = lambda plan: op_cpu.graph_compute(plan.graph)  # every node bound and run anew

    prompt = planned.tokenize("A long walk through the old town ends at the river, where " * 6)[:60]
    assert len(prompt) == 60
    np.testing.assert_array_equal(planned.context.decode(prompt).view(np.uint32),
                                  by_op.context.decode(prompt).view(np.uint32))
    token = prompt[-1]
    # across the 64th cell: the cells attention reads grow from 64 to 128 between steps
    for i in range(8):
        cpu.profile = OpProfile() if i % 3 == 2 else None  # the plan's steps one at a time, now and then
        a, b = planned.context.decode([token]), by_op.context.decode([token])
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        token = int(np.argmax(a[0]))
    cpu.profile = None
    step = plans[-1]
    tables = [run for run in step.runs if isinstance(run, TableRun)]
    # the whole step, from the token's embedding to the logits, in one table
    assert len(step.runs) == 1 and len(tables) == 1 and len(tables[0].steps) == len(step.steps)
    assert sum(len(s.calls) for s in tables[0].steps) > 300


def _table_step(writes: pg.Tensor, reads: tuple = ()) -> TableStep:
    return TableStep(lambda: [], prepare=lambda: None, reads=reads)


def test_a_step_whose_prepare_reads_what_its_table_wrote_starts_a_new_table(cpu):
    buft = cpu.get_device().get_buffer_type()
    a, b = pg.new_tensor(Type.F32, (8,), "a"), pg.new_tensor(Type.F32, (8,), "b")
    pg.alloc_tensors([a, b], buft)
    half = ops.view(a, (4,), offset=16)  # a's last four values
    first, second, third = _table_step(a), _table_step(b, reads=(b,)), _table_step(b, reads=(half,))
    runs = plan_runs([first, second], [[a], [b]])  # reads b, which only it writes
    assert [len(r.steps) for r in runs] == [2]
    runs = plan_runs([first, third], [[a], [b]])   # reads bytes of a, which the first wrote
    assert [len(r.steps) for r in runs] == [1, 1]
    python_step = lambda: None  # noqa: E731
    runs = plan_runs([first, python_step, second], [[a], [b], [b]])
    assert [type(r) for r in runs] == [TableRun, type(python_step), TableRun]


def test_an_empty_table_runs_nothing():
    run_calls([])


def test_attention_in_a_table_follows_the_cells_each_steps_mask_shows(cpu):
    """One head, three tokens: q's rows lie one after another, so attention runs as a table's
    call, which reads the step's mask cut to the cells some row sees - 64 in one step, 192 in
    the next, fewer again after - with the bits of op by op."""
    buft = cpu.get_device().get_buffer_type()
    d, n_tok, n_kv = 64, 3, 256
    q = pg.new_tensor(Type.F32, (d, n_tok, 1), "q")
    k, v = pg.new_tensor(Type.F16, (d, n_kv, 1), "k"), pg.new_tensor(Type.F16, (d, n_kv, 1), "v")
    mask = pg.new_tensor(Type.F32, (n_kv, n_tok), "mask")
    out = ops.flash_attn_ext(q, k, v, mask, d ** -0.5)
    graph = pg.build_forward(out)
    pg.alloc_graph(graph, buft)
    rng = np.random.default_rng(7)
    pg.tensor_set(q, rng.standard_normal((1, n_tok, d)).astype(np.float32))
    for t in (k, v):
        pg.tensor_set(t, rng.standard_normal((1, n_kv, d)).astype(np.float16))
    plan = cpu.graph_plan_create(graph)
    assert isinstance(plan.steps[0], TableStep)
    for reach in ((10, 40, 60), (10, 150, 190), (3, 3, 70), (255, 0, 1)):
        m = np.full((n_tok, n_kv), -np.inf, dtype=np.float32)
        for t, last in enumerate(reach):
            m[t, :last + 1] = rng.standard_normal(last + 1).astype(np.float32)
        pg.tensor_set(mask, m)
        cpu.graph_plan_compute(plan)
        planned = pg.tensor_array(out).copy()
        pg.tensor_set(out, np.full(out.ne[::-1], np.nan, dtype=np.float32))
        cpu.graph_compute(graph)
        assert np.isfinite(planned).all()
        np.testing.assert_array_equal(planned.view(np.uint32), pg.tensor_array(out).view(np.uint32))


def test_row_ids_out_of_range_stop_a_table_before_it_runs(cpu):
    """A plan's lookups and cache writes read their ids from the graph's inputs: checked before
    the table runs, so a bad id raises IndexError and no kernel writes through it."""
    from pyggml.quants import quantize
    buft = cpu.get_device().get_buffer_type()
    emb = pg.new_tensor(Type.Q8_0, (64, 10), "emb")
    ids = pg.new_tensor(Type.I32, (2,), "ids")
    x = ops.get_rows(emb, ids)
    cache = pg.new_tensor(Type.F16, (64, 4), "cache")
    cells = pg.new_tensor(Type.I64, (2,), "cells")
    written = ops.set_rows(cache, x, cells)
    graph = pg.build_forward(written)
    pg.alloc_graph(graph, buft)
    values = np.random.default_rng(1).standard_normal((10, 64)).astype(np.float32)
    pg.tensor_set(emb, quantize(values, Type.Q8_0))
    pg.tensor_set(cache, np.zeros((4, 64), dtype=np.float16))
    plan = cpu.graph_plan_create(graph)
    assert len(plan.runs) == 1 and all(isinstance(s, TableStep) for s in plan.steps)
    for good_ids, good_cells in (([3, 9], [0, 2]), ([0, 0], [3, 1])):
        pg.tensor_set(ids, np.array(good_ids, dtype=np.int32))
        pg.tensor_set(cells, np.array(good_cells, dtype=np.int64))
        cpu.graph_plan_compute(plan)
        np.testing.assert_array_equal(pg.tensor_array(cache).reshape(4, 64)[good_cells],
                                      pg.tensor_array(x).reshape(2, 64).astype(np.float16))
    before = pg.tensor_array(cache).copy()
    for bad_ids, bad_cells, what in (([3, 10], [0, 1], "GET_ROWS"), ([3, -1], [0, 1], "GET_ROWS"),
                                     ([3, 4], [0, 4], "SET_ROWS")):
        pg.tensor_set(ids, np.array(bad_ids, dtype=np.int32))
        pg.tensor_set(cells, np.array(bad_cells, dtype=np.int64))
        with pytest.raises(IndexError, match=f"{what}: index out of range"):
            cpu.graph_plan_compute(plan)
        np.testing.assert_array_equal(pg.tensor_array(cache), before)


def test_a_pool_gives_values_whose_steps_are_done_the_same_arrays():
    from pyggml.cpu.plan import ArrayPool
    pool = ArrayPool()
    small, large = (((4, 8), np.float32),), (((16, 8), np.float32),)
    a1 = pool.use("a", small)     # step 1
    b1 = pool.use("b", small)     # step 2: a still to be read
    a3 = pool.use("a", small)     # step 3: a's last step
    c4 = pool.use("c", small)     # step 4: a is done, b is not
    d5 = pool.use("d", large)     # step 5: other shapes
    b6 = pool.use("b", small)     # step 6
    e7 = pool.use("e", small)     # step 7: b and c are done
    (a,), (b,), (c,), (d,), (e,) = a1(), b1(), c4(), d5(), e7()
    assert a3()[0] is a and b6()[0] is b
    assert c is a and b is not a and d.shape == (16, 8)
    assert e is b or e is c
    with pytest.raises(RuntimeError):
        pool.use("f", small)  # after the arrays were made


def test_a_prompts_plan_holds_the_activations_of_a_few_products_not_of_every_layer(smollm2_path):
    m = pg.Model(smollm2_path, n_ctx=256, progress=False)
    cpu = _cpu_of(m)
    plans = []
    create = cpu.graph_plan_create

    def spy(graph):
        plans.append(create(graph))
        return plans[-1]
    cpu.graph_plan_create = spy
    m.context.decode(m.tokenize("The capital of France is a city that many people visit every year, and"))
    from pyggml.cpu.plan import ArrayPool
    pool = next(h for s in plans[0].steps if isinstance(s, TableStep) for h in s.hold if isinstance(h, ArrayPool))
    arrays = {id(a): a for made in pool._made.values() for a in made}
    per_layer = sum(a.nbytes for a in arrays.values()) / m.model.hp.n_layer
    assert len(pool._made) > 4 * m.model.hp.n_layer  # every product's bytes, every input's activations
    assert len(arrays) <= 12 and per_layer < 20_000


def test_a_buffer_keeps_its_tensors_views_until_freed(cpu):
    """tensor_view gives the same array for the same bytes, type, shape and strides (plans view
    a model's weights and their own tensors again and again), a new one for another shape, and
    none of a freed buffer's."""
    from pyggml.cpu.buffer import tensor_view
    buft = cpu.get_device().get_buffer_type()
    a = pg.new_tensor(Type.F32, (8, 2), "a")
    buffer = pg.alloc_tensors([a], buft)
    view = tensor_view(a)
    assert view.shape == (1, 1, 2, 8) and tensor_view(a) is view
    view[0, 0, 1, 3] = 5.0
    assert tensor_view(ops.view(a, (8, 2), offset=0)) is view  # another tensor over the same bytes
    assert tensor_view(ops.reshape(a, 16)) is not view and tensor_view(ops.reshape(a, 16))[0, 0, 0, 11] == 5.0
    buffer.free()
    assert not buffer._views

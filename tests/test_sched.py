"""Graph allocator and scheduler: memory reuse, splits across two devices, copies between them."""
from __future__ import annotations

import numpy as np
import pytest

import pyggml as pg
from pyggml import Type, ops
from pyggml.cpu import CPUDevice
from tests.conftest import ggml_activations


def _mlp(n_layers: int, dim: int, devices_of_layer, rng):
    """A chain of quantized linear layers with RMS norm and SiLU; returns (input, output, weights)."""
    x = pg.new_tensor(Type.F32, (dim, 4), "x").set_input()
    cur, weights = x, []
    for il in range(n_layers):
        w = pg.new_tensor(Type.Q4_0, (dim, dim), f"blk.{il}.w")
        pg.alloc_tensors([w], devices_of_layer(il).get_buffer_type())
        wv = rng.standard_normal((dim, dim)).astype(np.float32)
        pg.tensor_set(w, pg.quants.quantize(wv, Type.Q4_0))
        weights.append(pg.quants.dequantize(pg.quants.quantize(wv, Type.Q4_0), Type.Q4_0))
        cur = ops.silu(ops.rms_norm(ops.mul_mat(w, cur), 1e-5)).set_name(f"blk.{il}.out")
    return x, cur, weights


def _reference(xv, weights):
    cur = xv.astype(np.float64)
    for wv in weights:
        cur = ggml_activations(cur, Type.Q4_0)[0].astype(np.float64) @ wv.T
        cur = cur / np.sqrt((cur ** 2).mean(-1, keepdims=True) + 1e-5)
        cur = cur / (1 + np.exp(-cur))
    return cur


def test_allocator_reuses_dead_intermediates():
    rng = np.random.default_rng(0)
    cpu = pg.cpu_device()
    x, out, weights = _mlp(6, 64, lambda il: cpu, rng)
    graph = pg.build_forward(out)
    galloc = pg.alloc_graph(graph, cpu.get_buffer_type())
    one = 64 * 4 * 4  # one activation
    # 18 intermediates of one activation each; at most a few are alive at once
    assert galloc.get_buffer_size() <= 4 * one
    offsets = {n.offset for n in graph.nodes}
    assert len(offsets) < len(graph.nodes)
    xv = rng.standard_normal((4, 64)).astype(np.float32)
    pg.tensor_set(x, xv)
    cpu.init_backend().graph_compute(graph)
    assert np.allclose(pg.tensor_array(out)[0, 0], _reference(xv, weights), atol=1e-4)


def test_two_devices_match_one_device():
    """Two CPU devices stand in for two machines: layers alternate between them."""
    rng = np.random.default_rng(1)
    dev_a, dev_b = CPUDevice("CPU_A"), CPUDevice("CPU_B")
    cpu = pg.cpu_device()
    xv = np.random.default_rng(9).standard_normal((4, 64)).astype(np.float32)

    x, out, weights = _mlp(5, 64, lambda il: dev_a if il < 2 else dev_b, rng)
    graph = pg.build_forward(out)
    sched = pg.Scheduler([dev_a.init_backend(), dev_b.init_backend(), cpu.init_backend()])
    sched.alloc_graph(graph)
    pg.tensor_set(x, xv)
    sched.graph_compute(graph)
    split_result = pg.tensor_array(out)[0, 0]
    # layers 0-1 on A, 2-4 on B: two splits; the input comes from the CPU and activations cross over
    assert [s.backend_id for s in sched.splits] == [0, 1]
    assert sched.splits[0].copies and sched.splits[1].copies
    assert {n.buffer.get_type().get_name() for n in sched.splits[1].nodes} == {"CPU_B"}
    assert sched.n_copies > 0

    x1, out1, _ = _mlp(5, 64, lambda il: cpu, np.random.default_rng(1))
    g1 = pg.build_forward(out1)
    s1 = pg.Scheduler([cpu.init_backend()])
    s1.alloc_graph(g1)
    pg.tensor_set(x1, xv)
    s1.graph_compute(g1)
    assert s1.n_splits == 1
    assert np.array_equal(split_result, pg.tensor_array(out1)[0, 0])
    assert np.allclose(split_result, _reference(xv, weights), atol=1e-4)

    # computing the same graph again reuses the splits and gives the same answer
    splits_before = sched.splits
    pg.tensor_set(x, xv)
    sched.graph_compute(graph)
    assert sched.splits is splits_before
    assert np.array_equal(pg.tensor_array(out)[0, 0], split_result)


def test_devices_registry_lists_cpu():
    devs = pg.devices()
    assert devs and devs[0].get_type() == pg.DeviceType.CPU
    free, total = devs[0].get_memory()
    assert 0 < free <= total
    assert devs[0].get_name() == "CPU" and devs[0].get_description()


def test_a_new_graph_is_never_taken_for_the_last_one():
    """The scheduler reuses its split and allocation while the same graph comes back.  Here each
    graph is dropped just before the next one of the same size is built, as a chat's graphs
    for prompts of different lengths can be; the next graph then often gets the freed one's
    id(), and must still be split and allocated for its own shapes and data."""
    cpu = CPUDevice()
    sched = pg.Scheduler([cpu.init_backend()])
    graph = None
    for n in range(1, 40):
        a = pg.new_tensor(Type.F32, (4, n), "a")
        pg.alloc_tensors([a], cpu.get_buffer_type())
        pg.tensor_set(a, np.full((n, 4), n, np.float32))
        out = ops.scale(a, 2.0)
        graph = None  # the last graph is freed (unless something still holds it) ...
        graph = pg.build_forward(out)  # ... and its memory may serve this one
        sched.graph_compute(graph)
        np.testing.assert_array_equal(pg.tensor_array(out).reshape(n, 4), np.full((n, 4), 2 * n, np.float32))


def test_a_graph_that_comes_back_gets_its_splits_back_while_its_tensors_stay_put():
    """Alternating graphs (a context's prompt and decode graphs) hand the backends the same split
    graphs again - what a backend derived from them (an RPC server's copy, a captured CUDA graph)
    stays valid - but only while the allocation places their tensors where it did."""
    rng = np.random.default_rng(3)
    dev_a, dev_b = CPUDevice("CPU_A"), CPUDevice("CPU_B")
    sched = pg.Scheduler([dev_a.init_backend(), dev_b.init_backend(), pg.cpu_device().init_backend()])

    def chain(dim):
        x, out, weights = _mlp(4, dim, lambda il: dev_a if il < 2 else dev_b, rng)
        return x, out, weights, pg.build_forward(out)

    def run(x, out, weights, graph):
        xv = rng.standard_normal((4, x.ne[0])).astype(np.float32)
        sched.alloc_graph(graph)  # the input gets its place
        pg.tensor_set(x, xv)
        sched.graph_compute(graph)
        assert np.allclose(pg.tensor_array(out)[0, 0], _reference(xv, weights), atol=1e-4)
        return [s.graph for s in sched.splits]

    a, b, bigger = chain(64), chain(64), chain(256)
    first = run(*a)
    assert len(first) >= 2
    run(*b)
    again = run(*a)
    assert all(x is y for x, y in zip(first, again))  # same placement: the same split graphs
    run(*bigger)  # needs larger compute buffers: a's tensors move
    moved = run(*a)
    assert not any(x is y for x, y in zip(first, moved))


def test_an_op_its_device_cannot_run_in_place_is_a_clear_error():
    """A write into a tensor (a cache update) runs where the tensor's memory is; when that device
    lacks the op and the CPU cannot reach its memory (a GPU's), the scheduler says so instead of
    handing the CPU memory it cannot write."""
    class Picky(CPUDevice):
        def __init__(self):
            super().__init__("PICKY")
            self.buft.is_host = lambda: False  # as a GPU's memory

        def supports_op(self, op):
            return op.op != pg.Op.SET_ROWS and super().supports_op(op)

    dev = Picky()
    cache = pg.new_tensor(Type.F32, (16, 4), "cache")
    pg.alloc_tensors([cache], dev.get_buffer_type())
    src, idx = pg.new_tensor(Type.F32, (16, 1), "new").set_input(), pg.new_tensor(Type.I32, (1,), "row").set_input()
    sched = pg.Scheduler([dev.init_backend(), pg.cpu_device().init_backend()])
    with pytest.raises(NotImplementedError, match="PICKY cannot compute SET_ROWS .* in place"):
        sched.alloc_graph(pg.build_forward(ops.set_rows(cache, src, idx)))


def test_a_grown_compute_buffer_is_not_kept_alive_by_the_other_graphs_plans():
    """Plans hold views of the compute buffer; when a larger graph makes the scheduler allocate a
    bigger buffer, the plans of the graphs computed before must let the old one go."""
    import gc
    import weakref

    from pyggml.sched import Scheduler
    cpu = pg.cpu_device()
    sched = Scheduler([cpu.init_backend()])

    def graph(n: int):
        x = pg.new_tensor(Type.F32, (n, 4), "x").set_input()
        g = pg.build_forward(ops.silu(ops.scale(x, 2.0)))
        return g, x
    small, xs = graph(64)
    sched.alloc_graph(small)
    pg.tensor_set(xs, np.ones((4, 64), np.float32))
    sched.graph_compute(small)
    old = weakref.ref(sched.galloc.buffers[0].data)
    big, xb = graph(4096)
    sched.alloc_graph(big)
    pg.tensor_set(xb, np.ones((4, 4096), np.float32))
    sched.graph_compute(big)
    gc.collect()
    assert old() is None, "the first graph's plan still holds the freed compute buffer"
    sched.alloc_graph(small)  # and that graph is planned anew when it comes back
    pg.tensor_set(xs, np.full((4, 64), 3.0, np.float32))
    sched.graph_compute(small)
    assert np.allclose(pg.tensor_array(small.output()), 6.0 / (1 + np.exp(-6.0)))


def test_a_plan_reads_a_strided_weight_anew_at_every_step():
    """A plan made once computes every step from the bytes of that step: a batched product whose
    F16 matrices' rows lie apart (a permuted view of an input) must see the input's new values,
    not a copy gathered when the plan was made."""
    from pyggml.sched import Scheduler
    sched = Scheduler([pg.cpu_device().init_backend()])
    k, m, n = 32, 6, 3
    base = pg.new_tensor(Type.F16, (k, 2, m), "w").set_input()    # [m][2][k]
    x = pg.new_tensor(Type.F32, (k, n, 2), "x").set_input()
    graph = pg.build_forward(ops.mul_mat(ops.permute(base, 0, 2, 1, 3), x))  # weight i2: rows base[:, i2, :]
    sched.alloc_graph(graph)
    rng = np.random.default_rng(5)
    for _ in range(2):
        wv = rng.standard_normal((m, 2, k)).astype(np.float16)
        xv = rng.standard_normal((2, n, k)).astype(np.float32)
        pg.tensor_set(base, wv)
        pg.tensor_set(x, xv)
        sched.graph_compute(graph)
        want = np.einsum("mik,ink->inm", wv.astype(np.float64), xv.astype(np.float16).astype(np.float64))
        assert np.allclose(pg.tensor_array(graph.output()).reshape(2, n, m), want, rtol=1e-3, atol=1e-3)

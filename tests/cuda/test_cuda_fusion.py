"""Which ops the CUDA backend fuses (pyggml.cuda.kernels.fusions): an RMS norm with the MUL by its
weight that follows it, only where nothing else can read the norm's output.  Graph logic only,
no GPU; tests/cuda/test_cuda.py checks the fused results against the CPU."""
from __future__ import annotations

import pyggml as pg
from pyggml import ops
from pyggml.cuda.kernels import fusions

T = pg.Type


def split_graph(build) -> pg.Graph:
    """The graph of the first split a scheduler makes of ``build``'s output (one CPU backend)."""
    x, w = pg.new_tensor(T.F32, (64, 4), "x"), pg.new_tensor(T.F32, (64,), "w")
    w.flags |= pg.TensorFlag.PARAM
    out = build(x, w)
    sched = pg.Scheduler([pg.cpu_device().init_backend()])
    pg.alloc_tensors([w], pg.cpu_device().get_buffer_type())
    sched.alloc_graph(pg.build_forward(out))
    return sched.splits[0].graph


def test_a_norm_and_the_mul_by_its_weight_fuse():
    graph = split_graph(lambda x, w: ops.add(ops.mul(ops.rms_norm(x, 1e-6), w), x))
    plan = fusions(graph)
    assert [(graph.nodes[0].op, m.op) for m in plan.values()] == [(pg.Op.RMS_NORM, pg.Op.MUL)]


def test_no_fusion_when_the_norm_has_another_reader():
    def build(x, w):
        n = ops.rms_norm(x, 1e-6)
        return ops.add(ops.mul(n, w), n)
    assert fusions(split_graph(build)) == {}


def test_no_fusion_for_an_output_a_matrix_weight_or_an_unknown_graph():
    def marked(x, w):
        n = ops.rms_norm(x, 1e-6)
        n.set_output()
        return ops.mul(n, w)
    assert fusions(split_graph(marked)) == {}
    assert fusions(split_graph(lambda x, w: ops.mul(ops.rms_norm(x, 1e-6), x))) == {}  # not a weight vector
    graph = pg.build_forward(ops.mul(ops.rms_norm(pg.new_tensor(T.F32, (64, 4)), 1e-6), pg.new_tensor(T.F32, (64,))))
    assert graph.read_across is None and fusions(graph) == {}  # e.g. a graph that came over RPC

"""The CUDA backend against the CPU backend where the op table (tests/test_backend_ops.py, which
holds every op and weight type against float64 references on every device) does not reach:
prompt products past F16's range, fusions, the kernels' other paths, index errors, replayed and
captured graphs, whole synthetic and real models (normalized mean squared error thresholds).

These need CuPy (``pip install -e .[cuda]``) and a GPU; elsewhere they skip and say so, and
tests/cuda/test_cuda_emulated.py runs them on the CUDA emulator instead (tests/cuda/).
"""
from __future__ import annotations

import copy
import functools
import shutil

import numpy as np
import pytest
from pyggml.models import Context

import pyggml as pg
from pyggml import ops
from pyggml.cuda import cuda_devices
from pyggml.cuda.kernels import MMVQ_MAX_BATCH
from pyggml.ops import VIEW_OPS

from tests.conftest import shared_model
from tests.rpc.rpc_helpers import ServerProcess
from tests.cuda.test_cuda_kernels import random_weights

GPUS = cuda_devices()
pytestmark = pytest.mark.skipif(not GPUS, reason="no CUDA GPU here (or CuPy not installed: pip install -e .[cuda]); "
                                "tests/cuda/test_cuda_emulated.py runs these on the CUDA emulator")

T = pg.Type


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    want = want.astype(np.float64)
    return float(np.sum((got.astype(np.float64) - want) ** 2) / max(np.sum(want ** 2), 1e-30))


def prepare(device, build):
    """Build a graph whose sources all live on ``device`` (so that its nodes run there); return
    run(data): fill the sources with ``data``, compute the graph, return the output's values.
    Each run computes the same graph object, as a decode step does."""
    leaves: dict[str, pg.Tensor] = {}

    def leaf(name: str, type, ne):
        t = pg.new_tensor(type, ne, name)
        leaves[name] = t
        return t
    out = build(leaf)
    pg.alloc_tensors(leaves.values(), device.get_buffer_type())
    graph = pg.build_forward(out)
    backends = [device.init_backend()] if device.get_type() == pg.DeviceType.CPU else \
        [device.init_backend(), pg.cpu_device().init_backend()]
    sched = pg.Scheduler(backends)

    def run(data: dict[str, np.ndarray | bytes]) -> np.ndarray:
        for name, t in leaves.items():
            pg.tensor_set(t, data[name])
        sched.graph_compute(graph)
        return pg.tensor_array(out)
    run.sched, run.out = sched, out
    return run


def on_the_gpu(run) -> bool:
    """Whether prepare()'s graph, once run, computed its output on the GPU (not on the CPU the scheduler
    falls back to for an op the GPU lacks)."""
    return run.sched.get_tensor_backend(run.out).get_device().get_type() == pg.DeviceType.GPU


def run_on(device, build, data: dict[str, np.ndarray | bytes]) -> np.ndarray:
    return prepare(device, build)(data)


def compare(build, data, limit: float = 1e-6) -> None:
    want = run_on(pg.cpu_device(), build, data)
    got = run_on(GPUS[0], build, data)
    assert got.shape == want.shape
    err = nmse(got, want)
    assert err < limit, err


rng = np.random.default_rng(0)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("name, x_scale", [("Q8_0", 5e3), ("Q4_K", 5e3), ("F16", 5e3), ("Q8_0", 2e5), ("Q4_K", 2e5)])
def test_prompt_products_past_the_f16_range(name, x_scale, monkeypatch):
    """A prompt's products run on cuBLAS with F16 operands (pyggml/cuda/blas.py) and an F32
    result: sums past F16's 65504 stay finite, and so do activations past it (x_scale 2e5:
    scaled by a power of two before they become F16, the product scaled back).  Tiles of 32
    weight rows write into column blocks of the output, each a strided view.  (F16 weights
    take F16 activations on the CPU too: there, activations past 65504 are inf on both.)"""
    from pyggml.cuda import kernels as cuda_kernels
    monkeypatch.setattr(cuda_kernels, "GEMM_TILE_ROWS", 32)
    qtype, m, k, n = T[name], 96, 512, 40
    w = random_weights(qtype, m, k) if qtype.is_quantized else f32(m, k).astype(np.float16)
    data = {"w": w, "x": x_scale * f32(n, k)}

    def build(leaf):
        return ops.mul_mat(leaf("w", qtype, (k, m)), leaf("x", T.F32, (k, n)))
    want = run_on(pg.cpu_device(), build, data)
    assert np.abs(want).max() > 65504 * 1.5  # the test means something only if sums pass F16's range
    got = run_on(GPUS[0], build, data)
    assert np.isfinite(got).all()
    assert nmse(got, want) < 5e-4


@pytest.mark.parametrize("second_reader", [False, True])
def test_rms_norm_times_its_weight(second_reader):
    """Fused into one kernel (pyggml.cuda.kernels.fusions) unless the norm has another reader."""
    def build(leaf):
        n = ops.rms_norm(leaf("x", T.F32, (64, 5)), 1e-6)
        out = ops.mul(n, leaf("w", T.F32, (64,)))
        return ops.add(out, n) if second_reader else out
    compare(build, {"x": f32(5, 64), "w": f32(64)})


@pytest.mark.parametrize("op", ["rms_norm", "softmax", "swiglu"])
def test_fused_ops_into_an_f16_result(op):
    """A graph from another client (over RPC) may ask for an F16 result: computed in F32, stored as F16."""
    def build(leaf):
        x = leaf("x", T.F32, (64, 5))
        t = {"rms_norm": lambda: ops.rms_norm(x, 1e-6), "softmax": lambda: ops.soft_max_ext(x, None, 0.5),
             "swiglu": lambda: ops.swiglu(x)}[op]()
        t.type, t.nb = T.F16, pg.new_tensor(T.F16, t.ne).nb
        return t
    compare(build, {"x": f32(5, 64)}, limit=1e-5)


def test_products_of_one_input_share_its_quantization_and_no_other():
    """q/k/v-like products of one input reuse its q8_1 blocks within the graph; a product of
    another input of the same shape must not."""
    k, m = 256, 64
    ws = {f"w{i}": random_weights(T.Q4_K, m, k, seed=i) for i in range(3)}

    def build(leaf):
        x, y = leaf("x", T.F32, (k, 2)), leaf("y", T.F32, (k, 2))
        w = [leaf(f"w{i}", T.Q4_K, (k, m)) for i in range(3)]
        return ops.add(ops.add(ops.mul_mat(w[0], x), ops.scale(ops.mul_mat(w[1], x), 2.0, 0.0)),
                       ops.scale(ops.mul_mat(w[2], y), -3.0, 0.0))
    compare(build, {"x": f32(2, k), "y": f32(2, k), **ws}, limit=5e-4)


@pytest.mark.parametrize("case", ["norm", "reglu", "swiglu_gate_swapped", "softmax_mask_over_heads", "softmax_strided",
                                  "rope_freq_factors_yarn", "rms_norm_strided", "sub_repeating_over_rows",
                                  "div_of_a_permuted_view", "scale_of_a_permuted_view"])
def test_fused_kernels_on_their_other_paths(case):
    """The paths of the kernels (norm, glu, softmax, rope, element-wise) that the models above do not take."""
    x, g = f32(3, 5, 64), f32(3, 5, 64)
    build = {
        "norm": lambda leaf: ops.norm(leaf("x", T.F32, (64, 5, 3)), 1e-5),
        "reglu": lambda leaf: ops.glu(leaf("x", T.F32, (64, 5, 3)), None, pg.GluOp.REGLU),
        "swiglu_gate_swapped": lambda leaf: ops.glu(leaf("x", T.F32, (64, 5, 3)), leaf("g", T.F32, (64, 5, 3)),
                                                    pg.GluOp.SWIGLU, swapped=True),
        "softmax_mask_over_heads": lambda leaf: ops.soft_max_ext(leaf("x", T.F32, (64, 5, 3)),
                                                                 leaf("m", T.F32, (64, 8)), 0.7),
        "softmax_strided": lambda leaf: ops.soft_max_ext(ops.permute(leaf("x", T.F32, (64, 5, 3)), 0, 2, 1, 3)),
        "rope_freq_factors_yarn": lambda leaf: ops.rope_ext(
            leaf("x", T.F32, (64, 5, 3)), leaf("pos", T.I32, (3,)), leaf("ff", T.F32, (16,)), 32, pg.RopeMode.NEOX,
            n_ctx_orig=4096, freq_base=500000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=1.0),
        "rms_norm_strided": lambda leaf: ops.rms_norm(ops.permute(leaf("x", T.F32, (64, 5, 3)), 0, 2, 1, 3), 1e-6),
        "sub_repeating_over_rows": lambda leaf: ops.sub(leaf("x", T.F32, (64, 5, 3)), leaf("b", T.F32, (64, 1, 3))),
        "div_of_a_permuted_view": lambda leaf: ops.div(ops.permute(leaf("x", T.F32, (64, 5, 3)), 0, 2, 1, 3),
                                                       leaf("d", T.F32, (32, 3, 1))),
        "scale_of_a_permuted_view": lambda leaf: ops.scale(ops.permute(leaf("x", T.F32, (64, 5, 3)), 1, 0, 2, 3),
                                                           -2.0, 0.25),
    }[case]
    compare(build, {"x": x, "g": g, "b": f32(3, 1, 64), "d": rng.uniform(0.5, 2.0, (1, 3, 32)).astype(np.float32),
                    "m": f32(8, 64), "pos": np.array([0, 17, 4000], np.int32),
                    "ff": rng.uniform(1.0, 8.0, 16).astype(np.float32)})


def test_flash_attention_with_sinks_split_over_the_keys():
    """gpt-oss's sinks join the scores of every chunk when the chunks are combined: a sink above
    every score (the outputs shrink), one below, none (-inf); 200 cells are two chunks."""
    n_kv, d, heads, tokens = 200, 64, 4, 2
    compare(lambda leaf: ops.flash_attn_ext(leaf("q", T.F32, (d, tokens, heads)), leaf("k", T.F16, (d, n_kv, 2)),
                                            leaf("v", T.F16, (d, n_kv, 2)), None, d ** -0.5,
                                            sinks=leaf("s", T.F32, (heads,))),
            {"q": f32(heads, tokens, d), "k": f32(2, n_kv, d).astype(np.float16),
             "v": f32(2, n_kv, d).astype(np.float16), "s": np.array([8.0, -3.0, -np.inf, 0.5], np.float32)},
            limit=1e-5)


def test_flash_attention_with_softcap_and_one_token():
    n_kv, d, heads, kv_heads = 40, 256, 4, 1
    compare(lambda leaf: ops.flash_attn_ext(leaf("q", T.F32, (d, 1, heads)), leaf("k", T.F16, (d, n_kv, kv_heads)),
                                            leaf("v", T.F16, (d, n_kv, kv_heads)), None, d ** -0.5, logit_softcap=30.0),
            {"q": f32(heads, 1, d), "k": f32(kv_heads, n_kv, d).astype(np.float16),
             "v": f32(kv_heads, n_kv, d).astype(np.float16)}, limit=1e-5)


def test_set_rows_into_f32_and_an_index_out_of_range():
    compare(lambda leaf: ops.set_rows(leaf("cache", T.F32, (64, 8)), leaf("x", T.F32, (64, 2)), leaf("i", T.I32, (2,))),
            {"cache": np.zeros((8, 64), np.float32), "x": f32(2, 64), "i": np.array([7, 0], np.int32)})
    with pytest.raises(IndexError, match="SET_ROWS: index out of range"):
        run_on(GPUS[0], lambda leaf: ops.set_rows(leaf("cache", T.F16, (64, 8)), leaf("x", T.F32, (64, 2)),
                                                  leaf("i", T.I32, (2,))),
               {"cache": np.zeros((8, 64), np.float16), "x": f32(2, 64), "i": np.array([3, 8], np.int32)})


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0])
def test_get_rows_in_batches_and_an_index_out_of_range(qtype):
    """Indices [n, ne2, ne3] pick rows of the source's matching [ne2, ne3] slice; one out of range
    is reported after the graph (the kernel flags it: no host read per op)."""
    table = random_weights(qtype, 16 * 6, 64) if qtype.is_quantized else f32(16 * 6, 64).astype(qtype.np_dtype)

    def build(leaf):
        return ops.get_rows(leaf("t", qtype, (64, 16, 3, 2)), leaf("i", T.I32, (4, 3, 2)))
    compare(build, {"t": table, "i": rng.integers(0, 16, (2, 3, 4)).astype(np.int32)})
    with pytest.raises(IndexError, match="GET_ROWS: index out of range"):
        run_on(GPUS[0], build, {"t": table, "i": np.full((2, 3, 4), 16, np.int32)})
    compare(build, {"t": table, "i": np.zeros((2, 3, 4), np.int32)})  # the flag was cleared


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4, T.F16])
@pytest.mark.parametrize("n_tokens", [3, 40])
def test_mul_mat_id_on_both_paths_and_an_expert_out_of_range(qtype, n_tokens):
    """A decode step's few (token, slot) pairs run one matrix-vector launch that reads the ids on
    the GPU; 40 tokens x 2 slots (more than MMVQ_ID_MAX_PAIRS) are grouped by expert on the host.
    An expert id outside the experts is reported after the graph on the first path, at once on
    the second, and its products are never read from past the experts."""
    from pyggml.cuda.kernels import MMVQ_ID_MAX_PAIRS
    assert (n_tokens * 2 <= MMVQ_ID_MAX_PAIRS) == (n_tokens == 3)
    experts = random_weights(qtype, 16 * 6, 256) if qtype.is_quantized else f32(16 * 6, 256).astype(np.float16)

    def build(leaf):
        return ops.mul_mat_id(leaf("w", qtype, (256, 16, 6)), leaf("x", T.F32, (256, 1, n_tokens)),
                              leaf("ids", T.I32, (2, n_tokens)))
    ids = np.stack([rng.choice(5, 2, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    data = {"w": experts, "x": f32(n_tokens, 1, 256), "ids": ids}
    gpu = prepare(GPUS[0], build)
    gpu(data)
    assert on_the_gpu(gpu)
    compare(build, data, 1e-3 if qtype.is_quantized else 1e-6)
    bad = ids.copy()
    bad[-1, 1] = 6
    with pytest.raises(IndexError, match="MUL_MAT_ID: expert id out of range"):
        run_on(GPUS[0], build, {**data, "ids": bad})
    compare(build, data, 1e-3 if qtype.is_quantized else 1e-6)  # the flag was cleared


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_argsort_and_top_k_with_ties_and_nan_in_the_cpus_order(order):
    """The router's and the sampler's orders: equal values lowest index first, NaN last, rows of
    more elements than a thread block and k of one to all of them - the CPU's indices exactly."""
    x = np.round(f32(3, 300) * 2) / 2
    x[0, [5, 17, 250]] = np.nan
    sort_order = pg.opdefs.SortOrder.DESC if order == "desc" else pg.opdefs.SortOrder.ASC
    for build in (lambda leaf: ops.argsort(leaf("a", T.F32, (300, 3)), sort_order),
                  lambda leaf: ops.top_k(leaf("a", T.F32, (300, 3)), 1),
                  lambda leaf: ops.top_k(leaf("a", T.F32, (300, 3)), 40)):
        want, gpu = run_on(pg.cpu_device(), build, {"a": x}), prepare(GPUS[0], build)
        assert np.array_equal(gpu({"a": x}), want) and on_the_gpu(gpu)


def test_flash_attention_over_an_f16_cache():
    n_kv, d, heads, kv_heads, tokens = 32, 64, 4, 2, 3
    mask = np.where(np.arange(n_kv)[None, :] <= np.arange(tokens)[:, None] + 20, 0, -np.inf).astype(np.float32)
    compare(lambda leaf: ops.flash_attn_ext(leaf("q", T.F32, (d, tokens, heads)), leaf("k", T.F16, (d, n_kv, kv_heads)),
                                            leaf("v", T.F16, (d, n_kv, kv_heads)), leaf("m", T.F32, (n_kv, tokens)),
                                            d ** -0.5),
            {"q": f32(heads, tokens, d), "k": f32(kv_heads, n_kv, d).astype(np.float16),
             "v": f32(kv_heads, n_kv, d).astype(np.float16), "m": mask}, limit=1e-5)


# -- replay: a graph computed again runs its recorded launches (pyggml/cuda/replay.py) --------

def a_decode_step(leaf):
    """A layer's worth of a decode step: embedding rows, a norm times its weight, two products
    sharing one quantized input, a residual add; every op one kernel launch."""
    x = ops.get_rows(leaf("emb", T.Q8_0, (256, 10)), leaf("tok", T.I32, (2,)))
    h = ops.mul(ops.rms_norm(x, 1e-6), leaf("nw", T.F32, (256,)))
    q = ops.mul_mat(leaf("wq", T.Q4_K, (256, 128)), h)
    k = ops.mul_mat(leaf("wk", T.Q6_K, (256, 128)), h)
    return ops.add(ops.scale(ops.add(q, k), 0.5), ops.view(x, (128, 2), (x.nb[1],)))


def decode_step_data(i: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(100 + i)  # new activations and tokens each step, the same weights
    return {"emb": random_weights(T.Q8_0, 10, 256, seed=1), "tok": r.integers(0, 10, 2).astype(np.int32),
            "nw": np.random.default_rng(2).standard_normal(256).astype(np.float32),
            "wq": random_weights(T.Q4_K, 128, 256, seed=3), "wk": random_weights(T.Q6_K, 128, 256, seed=4)}


def counting_device_operations(run):
    """run, with run.device_ops[-1] the device operations its GPU graph_plan_compute made (the CUDA
    emulator's CuPy counts them; a real CuPy does not, and the list stays empty)."""
    import cupy
    backend, run.device_ops = run.sched.backends[0], []
    compute = backend.graph_plan_compute

    def counted(plan):
        before = getattr(cupy, "launches", None)
        compute(plan)
        if before is not None:
            run.device_ops.append(cupy.launches - before)
    backend.graph_plan_compute = counted
    return run


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_a_graph_computed_again_replays_its_launches(graphs, monkeypatch):
    """Run 2 records the launches, run 3 captures them as a CUDA graph (or, with
    PYGGML_CUDA_GRAPHS=0, replays them one by one): each run's result is bit-identical to the
    op table's on the same inputs, which change every run."""
    monkeypatch.setenv("PYGGML_CUDA_GRAPHS", graphs)
    gpu = counting_device_operations(prepare(GPUS[0], a_decode_step))
    monkeypatch.setenv("PYGGML_CUDA_REPLAY", "0")
    eager = counting_device_operations(prepare(GPUS[0], a_decode_step))
    cpu = prepare(pg.cpu_device(), a_decode_step)
    for i in range(5):
        monkeypatch.setenv("PYGGML_CUDA_REPLAY", "0")
        want = eager(decode_step_data(i))
        monkeypatch.setenv("PYGGML_CUDA_REPLAY", "1")
        got = gpu(decode_step_data(i))
        assert np.array_equal(got, want), f"run {i + 1}"
        assert nmse(got, cpu(decode_step_data(i))) < 5e-4
    state = gpu.sched.splits[0].plan.replay
    assert len(state.launches) == 8  # get_rows, norm+mul, quantize, 2 products, add, scale, add
    assert bool(state.captured) == (graphs == "1")
    if gpu.device_ops:  # the emulator: the op table launched exactly what was recorded, nothing else
        assert eager.device_ops == [8] * 5
        assert gpu.device_ops == [8, 8] + ([1] * 3 if graphs == "1" else [8] * 3)


def test_gpt_oss_small_ops_on_the_gpu_and_an_add_id_out_of_range():
    """gpt-oss's per-expert biases (ADD_ID, ids read on the GPU), its clamped SwiGLU and the
    softmax with attention sinks run on the GPU with the CPU's results; an ADD_ID id outside the
    experts is reported and the next graph is clean."""
    def build_add_id(leaf):
        return ops.add_id(leaf("a", T.F32, (64, 2, 3)), leaf("b", T.F32, (64, 5)), leaf("ids", T.I32, (2, 3)))
    ids = np.array([[0, 4], [2, 1], [3, 3]], dtype=np.int32)
    data = {"a": f32(3, 2, 64), "b": f32(5, 64), "ids": ids}
    gpu = prepare(GPUS[0], build_add_id)
    assert np.array_equal(gpu(data), run_on(pg.cpu_device(), build_add_id, data)) and on_the_gpu(gpu)
    with pytest.raises(IndexError, match="ADD_ID: id out of range"):
        run_on(GPUS[0], build_add_id, {**data, "ids": np.where(ids == 4, 5, ids).astype(np.int32)})
    compare(build_add_id, data, 1e-30)  # exact; the flag was cleared

    def build_oai(leaf):
        return ops.swiglu_oai(leaf("g", T.F32, (64, 4)), leaf("u", T.F32, (64, 4)), 1.702, 7.0)
    gpu = prepare(GPUS[0], build_oai)
    oai = {"g": f32(4, 64) * 6, "u": f32(4, 64) * 6}  # past the limit too
    gpu(oai)
    assert on_the_gpu(gpu)
    compare(build_oai, oai, 1e-12)

    def build_sinks(leaf):
        return ops.soft_max_ext(leaf("x", T.F32, (32, 5, 4)), None, 0.5, sinks=leaf("s", T.F32, (4,)))
    gpu = prepare(GPUS[0], build_sinks)
    sinks = {"x": f32(4, 5, 32), "s": np.array([0.5, -2.0, 4.0, -np.inf], np.float32)}
    gpu(sinks)
    assert on_the_gpu(gpu)
    compare(build_sinks, sinks, 1e-12)


def test_an_index_out_of_range_is_reported_from_a_captured_graph_too():
    run = prepare(GPUS[0], a_decode_step)
    for i in range(3):
        run(decode_step_data(i))
    assert run.sched.splits[0].plan.replay.captured
    with pytest.raises(IndexError, match="GET_ROWS: index out of range"):
        run({**decode_step_data(3), "tok": np.array([0, 10], np.int32)})
    run(decode_step_data(4))  # and the flag was cleared


def test_a_graph_with_an_op_that_is_not_a_launch_is_never_recorded():
    run = prepare(GPUS[0], lambda leaf: ops.add(ops.tanh(leaf("a", T.F32, (64, 4))), leaf("b", T.F32, (64, 4))))
    cpu = prepare(pg.cpu_device(), lambda leaf: ops.add(ops.tanh(leaf("a", T.F32, (64, 4))), leaf("b", T.F32, (64, 4))))
    for _ in range(4):
        data = {"a": f32(4, 64), "b": f32(4, 64)}
        assert nmse(run(data), cpu(data)) < 1e-6
    state = run.sched.splits[0].plan.replay
    assert state.eager and state.launches is None


def test_a_failed_capture_falls_back_to_replaying_the_launches(monkeypatch):
    from pyggml.cuda import replay

    def refuse(launches):
        raise RuntimeError("capture refused")
    monkeypatch.setattr(replay, "capture", refuse)
    run, cpu = prepare(GPUS[0], a_decode_step), prepare(pg.cpu_device(), a_decode_step)
    for i in range(4):
        if i == 2:
            with pytest.warns(RuntimeWarning, match="capture failed .*capture refused"):
                got = run(decode_step_data(i))
        else:
            got = run(decode_step_data(i))
        assert nmse(got, cpu(decode_step_data(i))) < 5e-4
    assert run.sched.splits[0].plan.replay.captured is False


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_flash_attention_split_over_the_keys(softcap):
    """300 cells: three chunks of ATTN_SPLIT keys (the last one partial) combined per row; the
    mask hides every key past 150 + t, so the third chunk is all masked for every token."""
    n_kv, d, heads, kv_heads, tokens = 300, 64, 4, 2, 3
    mask = np.where(np.arange(n_kv)[None, :] <= np.arange(tokens)[:, None] + 150, 0, -np.inf).astype(np.float32)
    compare(lambda leaf: ops.flash_attn_ext(leaf("q", T.F32, (d, tokens, heads)), leaf("k", T.F16, (d, n_kv, kv_heads)),
                                            leaf("v", T.F16, (d, n_kv, kv_heads)), leaf("m", T.F32, (n_kv, tokens)),
                                            d ** -0.5, logit_softcap=softcap),
            {"q": f32(heads, tokens, d), "k": f32(kv_heads, n_kv, d).astype(np.float16),
             "v": f32(kv_heads, n_kv, d).astype(np.float16), "m": mask}, limit=1e-5)


def test_out_of_memory_names_the_device_the_request_and_the_free_memory():
    _, total = GPUS[0].get_memory()
    with pytest.raises(MemoryError, match=r"CUDA0: out of memory allocating [\d.]+ MiB \([\d.]+ MiB free of"):
        GPUS[0].get_buffer_type().alloc_buffer(total + (1 << 30))


def test_a_kernel_that_fails_to_compile_names_its_file_and_line(tmp_path, monkeypatch):
    from pyggml.cuda import runtime
    shutil.copy(runtime.KERNEL_DIR / "common.cuh", tmp_path)
    (tmp_path / "broken_kernel.cu").write_text(
        '#include "common.cuh"\n\nextern "C" __global__ void k(float *y) { y[0] = undefined_name; }\n')
    monkeypatch.setattr(runtime, "KERNEL_DIR", tmp_path)
    with pytest.raises(runtime.KernelCompileError, match=r"CUDA kernel kernels/broken_kernel\.cu:3 failed to compile"):
        runtime.module("broken_kernel.cu")


# -- whole models on the GPU from model files written here: the real models cannot be carried to
# a GPU machine (no network there, and too large to bring along), these can be written there

SYNTHETIC_TOKENS = [5, 17, 3, 99, 42, 7, 64, 1, 120, 33, 8, 77]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_models_whole_on_the_gpu(arch, tmp_path):
    """tests/models/synthetic.py's tiny random models (F32 weights; qwen2's q/k/v biases, qwen3's q/k
    norms and NEOX RoPE) with every layer on the GPU, against the independent numpy forward
    pass: the prompt in one batch, then the same tokens as decode steps."""
    from pyggml.models import load_model
    from pyggml.models.loader import default_devices

    from tests.models.synthetic import Shape, random_weights, reference_logits, write_model
    s = Shape()
    weights = random_weights(arch, s, seed=len(arch))
    model = load_model(write_model(tmp_path / f"{arch}.gguf", arch, s, weights), "all", default_devices(),
                       progress=False)
    assert model.layer_device(0).get_name() == "CUDA0"
    want = reference_logits(arch, s, weights, SYNTHETIC_TOKENS)
    assert nmse(Context(model, n_ctx=64).decode(SYNTHETIC_TOKENS, all_logits=True), want) < 1e-5
    ctx = Context(model, n_ctx=64)
    ctx.decode(SYNTHETIC_TOKENS[:5])
    steps = np.concatenate([ctx.decode([t]) for t in SYNTHETIC_TOKENS[5:]])
    assert nmse(steps, want[5:]) < 1e-5
    model.free()


def test_a_quantized_model_whole_on_the_gpu(tmp_path):
    """A tiny llama with its matrices in Q4_K (FFN down Q6_K, output Q6_K, embedding Q8_0, as
    llama.cpp's Q4_K_M): the GPU's logits near the CPU's on the same file, for the prompt and
    for decode steps, which run from a captured CUDA graph from the third step on."""
    from tests.models.synthetic import Shape, random_weights, write_model
    s = Shape(n_embd=256, n_ff=512, n_vocab=256)
    weights = random_weights("llama", s, seed=11)
    types = {name: "Q6_K" if "ffn_down" in name or name == "output.weight" else
             "Q8_0" if name == "token_embd.weight" else "Q4_K" for name, v in weights.items() if v.ndim == 2}
    path = write_model(tmp_path / "llama-q4_k_m.gguf", "llama", s, weights, types)
    (cpu_batch, cpu_steps, _), (gpu_batch, gpu_steps, sched) = (prompt_and_steps(path, ngl) for ngl in (None, "all"))
    assert nmse(gpu_batch, cpu_batch) < 1e-3 and nmse(gpu_steps, cpu_steps) < 1e-3
    assert sched.splits[0].plan.replay.captured


def prompt_and_steps(path, ngl) -> tuple[np.ndarray, np.ndarray, pg.Scheduler]:
    """A model file's logits for SYNTHETIC_TOKENS in one batch, then for its tokens from the 5th
    on as decode steps (the third step on from a captured CUDA graph), and the steps' scheduler."""
    from pyggml.models import load_model
    from pyggml.models.loader import default_devices
    model = load_model(path, ngl, default_devices(), progress=False)
    batch = Context(model, n_ctx=64).decode(SYNTHETIC_TOKENS, all_logits=True)
    ctx = Context(model, n_ctx=64)
    ctx.decode(SYNTHETIC_TOKENS[:4])
    steps = np.concatenate([ctx.decode([t]) for t in SYNTHETIC_TOKENS[4:]])
    model.free()
    return batch, steps, ctx.sched


@pytest.mark.parametrize("arch, experts", [("qwen3moe", "Q4_K"), ("qwen3moe", "F32"), ("gpt-oss", "MXFP4")])
def test_a_mixture_of_experts_whole_on_the_gpu(arch, experts, tmp_path):
    """A tiny qwen3moe (tests/models/test_moe.py's kind: router, top-k, renormalized weights, experts)
    or gpt-oss (MXFP4 experts with their biases, attention sinks, clamped SwiGLU, sliding windows)
    with every node on the GPU - no split falls back to the CPU - near the CPU's logits for the
    prompt and for decode steps, which run from a captured CUDA graph (every MoE op a launch)."""
    from tests.models.synthetic import Shape, expert_types, random_weights, write_model
    s = Shape(n_embd=256, n_ff_exp=256, n_vocab=256)
    weights = random_weights(arch, s, seed=12, moe=True)
    path = write_model(tmp_path / f"{arch}.gguf", arch, s, weights,
                       expert_types(weights, None if experts == "F32" else experts, "Q6_K"))
    (cpu_batch, cpu_steps, _), (gpu_batch, gpu_steps, sched) = (prompt_and_steps(path, ngl) for ngl in (None, "all"))
    assert [sched.backends[sp.backend_id].get_device().get_type() for sp in sched.splits] == [pg.DeviceType.GPU], \
        [(sched.backends[sp.backend_id].get_name(), [n.op.name for n in sp.nodes][:8]) for sp in sched.splits]
    assert sched.splits[0].plan.replay.captured  # F32 router and experts too: kernels/mmv.cu, not cuBLAS
    limit = 1e-3 if experts != "F32" else 1e-5
    assert nmse(gpu_batch, cpu_batch) < limit and nmse(gpu_steps, cpu_steps) < limit


# 33 tokens (SmolLM2) / 34 (Gemma 3): more than MMVQ_MAX_BATCH, so the whole prompt runs the
# prompt path (dequantized F16 tiles, cuBLAS); its first 12 tokens alone run the quantized
# matrix-vector kernel, in batches of up to 8 columns; generation runs it with one.
PROMPT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. "
          "The capital of Germany is Berlin. The capital of Portugal is")
SHORT = 12


@functools.cache
def cpu_reference(alias: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The prompt's tokens, the CPU's logits for the whole prompt, and its logits for the same
    tokens one at a time.  Their difference is the CPU's own spread (llama.cpp's CPU kernels,
    which the CPU backend reproduces, round differently for one token than for many; both
    round activations to 8 bits, as the GPU does to q8_1)."""
    cpu_model = shared_model(alias)
    ids = cpu_model.tokenize(PROMPT)
    want = cpu_model.logits(ids)
    one_by_one = Context(cpu_model.model, n_ctx=64)
    singles = np.stack([one_by_one.decode([t])[-1] for t in ids])
    one_by_one.free()
    return ids, want, singles


def assert_close_to_the_cpu(alias: str, got: np.ndarray) -> None:
    """The GPU's logits for the first len(got) tokens may differ from the CPU's by a multiple of
    the CPU's own spread over those tokens.  Last-bit changes are amplified through the 8-bit
    rounding of every layer's activations, so the ratio moves with any reordering of a kernel's
    sums (observed on the emulated GPU: 0.9x-3.1x with kernels of the same per-product
    accuracy); a wrong op or placement gives errors of order one.  Kernel accuracy itself is
    held much tighter, product by product (test_cuda_kernels.py)."""
    _, want, singles = cpu_reference(alias)
    want = want[:len(got)]
    spread, err = nmse(singles[:len(got)], want), nmse(got, want)
    assert np.isfinite(got).all()
    assert err < 10 * spread, f"NMSE {err:.2e} against the CPU, {err / spread:.1f}x the CPU's own spread {spread:.2e}"
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_real_model_logits_match_the_cpu(alias):
    ids, _, _ = cpu_reference(alias)
    assert len(ids) > MMVQ_MAX_BATCH > SHORT
    with pg.Model(alias, n_ctx=256, ngl="all", progress=False) as gpu_model:
        got = gpu_model.logits(ids)
        sched = gpu_model.context.sched  # -ngl all: every op of the graph ran on the GPU, none fell back
        assert [sched.backends[s.backend_id].get_name() for s in sched.splits] == ["CUDA0"]
        got_short = gpu_model.logits(ids[:SHORT])
        greedy = list(gpu_model.generate(ids, max_tokens=8, temperature=0))
    assert_close_to_the_cpu(alias, got)
    assert_close_to_the_cpu(alias, got_short)
    assert greedy[:4] == list(shared_model(alias).generate(ids, max_tokens=4, temperature=0))


def test_real_model_decode_steps_from_a_captured_graph_match_the_op_table(monkeypatch):
    """SmolLM2's decode steps, run by the op table (PYGGML_CUDA_REPLAY=0) and then from the
    recorded launches captured as a CUDA graph: bit-identical logits, step by step."""
    ids = cpu_reference("smollm2")[0][:SHORT]
    with pg.Model("smollm2", n_ctx=64, ngl="all", progress=False) as m:
        def steps() -> tuple[np.ndarray, object, int]:
            m.context.clear()
            m.context.decode(ids[:4])
            logits = np.concatenate([m.context.decode([t]) for t in ids[4:]])  # one graph, 8 steps
            split = m.context.sched.splits[0]
            state = copy.copy(split.plan.replay)  # as it is now (the next steps() may find the same plan)
            return logits, state, len(split.plan.fusions), sum(n.op not in VIEW_OPS for n in split.graph.nodes)
        monkeypatch.setenv("PYGGML_CUDA_REPLAY", "0")
        eager, eager_state, _, _ = steps()
        monkeypatch.setenv("PYGGML_CUDA_REPLAY", "1")
        replayed, state, n_fused, n_ops = steps()
    assert eager_state.launches is None and state.captured
    assert len(state.launches) >= n_ops - n_fused  # a launch (or more) per op
    assert np.array_equal(eager, replayed)


def test_real_model_through_an_rpc_server_that_lends_the_gpu():
    """pyggml-rpc-server --device 0 (GPUs come first: device 0 is CUDA0) in a process of its own;
    the client runs SmolLM2 on it.  Generation sends each decode step as GRAPH_RECOMPUTE, so the
    server records the step's launches on its second run and launches a CUDA graph from the third."""
    ids, _, _ = cpu_reference("smollm2")
    server = ServerProcess("--device", "0")
    try:
        assert "device 0: CUDA0" in server.banner[1], server.banner
        with pg.Model("smollm2", n_ctx=256, rpc=server.endpoint, ngl="0:all", progress=False) as remote:
            assert remote.model.layer_device(0).get_name() == f"RPC[{server.endpoint}]"
            got = remote.logits(ids)
            remote.context.clear()
            greedy = list(remote.generate(ids[:SHORT], max_tokens=5, temperature=0))
    finally:
        server.stop()
    assert_close_to_the_cpu("smollm2", got)
    cpu = shared_model("smollm2")
    cpu.context.clear()
    assert greedy[:4] == list(cpu.generate(ids[:SHORT], max_tokens=4, temperature=0))

"""MUL_MAT with every weight type against dequantize-then-matmul in float64, with the
activations rounded the way ggml's vec_dot_type holds them (tests/conftest.py)."""
from __future__ import annotations

import numpy as np
import pytest

import pyggml as pg
from pyggml import Type, ops
from pyggml.cpu import qmatmul
from tests.conftest import ggml_mul_mat_reference, run_graph
from tests.test_quants import random_blocks

WEIGHT_TYPES = [t for t in Type if t.is_quantized] + [Type.F16, Type.BF16, Type.F32]


def weight(qtype: Type, m: int, k: int, seed: int) -> tuple[pg.Tensor, np.ndarray, np.ndarray]:
    """A weight tensor [k, m] in qtype, its exact float values and its bytes."""
    if qtype.is_quantized:
        raw = random_blocks(qtype, n_rows=m, blocks_per_row=k // qtype.block_size, seed=seed)
    else:
        raw = pg.quants.quantize(np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32), qtype)
    w = pg.new_tensor(qtype, (k, m), f"w_{qtype.name}")
    pg.alloc_tensors([w], pg.cpu_device().get_buffer_type())
    pg.tensor_set(w, raw)
    raw = raw.view(np.uint8).reshape(m, -1)
    return w, pg.quants.dequantize(raw, qtype).astype(np.float64), raw


@pytest.mark.parametrize("n_cols", [1, 3, qmatmul.FUSED_MAX_COLS + 5], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=lambda t: t.name)
def test_mul_mat_weight_types(qtype, n_cols):
    k, m = 512, 37
    w, wv, raw = weight(qtype, m, k, seed=int(qtype))
    x = pg.new_tensor(Type.F32, (k, n_cols), "x").set_input()
    xv = np.random.default_rng(1).standard_normal((n_cols, k)).astype(np.float32)
    out = run_graph(ops.mul_mat(w, x), {x: xv})[0, 0]
    ref = ggml_mul_mat_reference(xv, raw, qtype)
    err = float(((out - ref) ** 2).sum() / (ref ** 2).sum())
    assert out.shape == (n_cols, m)
    assert err < 1e-10, f"{qtype.name}: nmse {err} against ggml's arithmetic"
    exact = xv.astype(np.float64) @ wv.T  # and 8-bit activations cost little accuracy
    assert float(((out - exact) ** 2).sum() / (exact ** 2).sum()) < 1e-3


@pytest.mark.parametrize("k", [96, 160])
@pytest.mark.parametrize("qtype", [Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0], ids=lambda t: t.name)
def test_batched_32_element_types_with_rows_of_odd_32s(qtype, k):
    """Batches of the 32-element types unpack rows into bytes padded to whole 64s; a row of
    K % 64 == 32 once unpacked one block past its end into the scratch (seen only with numba's
    bounds checks: tests/cpu/test_boundscheck.py runs this file with them on)."""
    m, n_cols = 7, 6
    w, _, raw = weight(qtype, m, k, seed=k)
    x = pg.new_tensor(Type.F32, (k, n_cols), "x").set_input()
    xv = np.random.default_rng(2).standard_normal((n_cols, k)).astype(np.float32)
    out = run_graph(ops.mul_mat(w, x), {x: xv})[0, 0]
    ref = ggml_mul_mat_reference(xv, raw, qtype)
    assert float(((out - ref) ** 2).sum() / (ref ** 2).sum()) < 1e-10


def test_quantized_mul_mat_batched_weights():
    """A 3-D quantized first operand broadcast over b's batch dimension."""
    k, m = 64, 5
    data = np.random.default_rng(3).standard_normal((2, m, k)).astype(np.float32)
    raw = pg.quants.quantize(data, Type.Q8_0)
    w = pg.new_tensor(Type.Q8_0, (k, m, 2), "w3")
    pg.alloc_tensors([w], pg.cpu_device().get_buffer_type())
    pg.tensor_set(w, raw)
    x = pg.new_tensor(Type.F32, (k, 3, 4), "x").set_input()
    xv = np.random.default_rng(4).standard_normal((4, 3, k)).astype(np.float32)
    out = run_graph(ops.mul_mat(w, x), {x: xv})[0]
    ref = np.stack([ggml_mul_mat_reference(xv[i], raw[i // 2], Type.Q8_0) for i in range(4)])  # b's batch i reads a's i // 2
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_integer_dispatch_matches_the_decoders():
    """The cached kernels pick a decoder by number (kinds.Dec); each number must pick its type's."""
    from pyggml.cpu.kinds import DECODER
    from pyggml.cpu.qdecode import DECODERS, F16_TABLE, decode_row
    rng = np.random.default_rng(5)
    for qtype, decoder in DECODERS.items():
        row = rng.integers(0, 256, size=qtype.row_size(512), dtype=np.uint8)
        if qtype.is_quantized:  # finite scales: random f16 bit patterns include NaN
            blocks = row.view(pg.quants.layouts.LAYOUTS[qtype])
            for field in ("d", "m", "dmin"):
                if field in blocks.dtype.names:
                    blocks[field] = np.float32(0.01) if blocks.dtype[field] == np.float32 else np.float16(0.01)
        want, got = np.empty(512, np.float32), np.empty(512, np.float32)
        decoder(row, want, F16_TABLE)
        decode_row(int(DECODER[qtype]), row, got, F16_TABLE)
        np.testing.assert_array_equal(got, want, err_msg=qtype.name)


def experts(qtype: Type, n_expert: int, m: int, k: int, rng) -> tuple[pg.Tensor, np.ndarray]:
    """Stacked expert weights [k, m, n_expert] of normal values in qtype, and their bytes."""
    raw = np.stack([pg.quants.quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).view(np.uint8).reshape(m, -1)
                    for _ in range(n_expert)])
    w = pg.new_tensor(qtype, (k, m, n_expert), "experts")
    pg.alloc_tensors([w], pg.cpu_device().get_buffer_type())
    pg.tensor_set(w, raw)
    return w, raw


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_mul_mat_id_in_one_call_equals_each_experts_product(name):
    """MUL_MAT_ID computes every expert's product as calls of one table (cpu/experts.py); each
    must be the bits of that expert's own product of the tokens routed to it - a single
    token, a batch of 5 (the 32-element types' unpacked path) and of 9 (the K-quants' tiled one)."""
    qtype, n_expert, m, k, n_tokens, n_used = Type[name], 6, 34, 256, 16, 2
    rng = np.random.default_rng(7)
    w, raw = experts(qtype, n_expert, m, k, rng)
    ids = np.zeros((n_tokens, n_used), dtype=np.int32)
    ids[:, 0] = 4                                      # 16 tokens on expert 4
    ids[:, 1] = [1] * 9 + [2] * 5 + [5, 3]             # 9, 5, 1, 1 on others
    x = rng.standard_normal((n_tokens, 1, k)).astype(np.float32)
    b = pg.new_tensor(Type.F32, (k, 1, n_tokens), "b").set_input()
    idt = pg.new_tensor(Type.I32, (n_used, n_tokens), "ids").set_input()
    got = run_graph(ops.mul_mat_id(w, b, idt), {b: x, idt: ids}).reshape(n_tokens, n_used, m)
    for e in np.unique(ids):
        t_sel, u_sel = np.nonzero(ids == e)
        want = qmatmul.quant_matmul(raw[e], qtype, x[t_sel, 0])
        assert np.array_equal(got[t_sel, u_sel], want), f"expert {e}"


def test_mul_mat_id_reads_its_ids_and_activations_through_strides_and_from_the_graph():
    """The table's MUL_MAT_ID (cpu/experts.py) takes its ids as the step computes them - a
    router's top k, here of a view whose rows lie apart - and activations whose rows lie apart
    (a slot's row of b, a token's rows of b): each pair's row is that expert's product alone."""
    qtype, n_expert, m, k, n_tokens, n_used = Type.Q4_0, 5, 24, 64, 6, 3
    rng = np.random.default_rng(21)
    w, raw = experts(qtype, n_expert, m, k, rng)
    scores_v = rng.standard_normal((n_tokens, n_expert + 3)).astype(np.float32)
    big_v = rng.standard_normal((n_tokens, n_used + 1, k + 32)).astype(np.float32)
    scores = pg.new_tensor(Type.F32, (n_expert + 3, n_tokens), "scores").set_input()
    big = pg.new_tensor(Type.F32, (k + 32, n_used + 1, n_tokens), "big").set_input()
    routed = ops.view(ops.top_k(ops.view(scores, (n_expert, n_tokens), (scores.nb[1],)), n_used + 1),
                      (n_used, n_tokens), ((n_used + 1) * 4,))       # slots 0..n_used-1 of a top k+1
    b = ops.view(big, (k, n_used, n_tokens), (big.nb[1], big.nb[2]), offset=4 * 8)
    got = run_graph(ops.mul_mat_id(w, b, routed), {scores: scores_v, big: big_v}).reshape(n_tokens, n_used, m)
    ids = np.argsort(-scores_v[:, :n_expert], axis=1, kind="stable")[:, :n_used]
    x = big_v[:, :n_used, 8:8 + k]
    for t in range(n_tokens):
        for u in range(n_used):
            want = qmatmul.quant_matmul(raw[ids[t, u]], qtype, x[t, u][None])
            assert np.array_equal(got[t, u], want[0]), (t, u)


@pytest.mark.parametrize("bad", [6, -1])
def test_an_expert_id_outside_the_quantized_experts_is_an_error_and_the_plan_runs_on(bad):
    """An id outside the experts is found by the table's route (it reads expert 0 instead, so
    nothing reads past the weights) and raised once the table has run; the same plan then
    computes the next ids right."""
    qtype, n_expert, m, k = Type.Q8_0, 6, 16, 64
    rng = np.random.default_rng(5)
    w, raw = experts(qtype, n_expert, m, k, rng)
    b = pg.new_tensor(Type.F32, (k, 1, 2), "b").set_input()
    idt = pg.new_tensor(Type.I32, (2, 2), "ids").set_input()
    out = ops.mul_mat_id(w, b, idt)
    graph = pg.build_forward(out)
    sched = pg.Scheduler([pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    x = rng.standard_normal((2, 1, k)).astype(np.float32)
    pg.tensor_set(b, x)
    pg.tensor_set(idt, np.array([[1, 2], [bad, 3]], np.int32))
    with pytest.raises(ValueError, match=f"MUL_MAT_ID: expert id {bad} outside 0..5"):
        sched.graph_compute(graph)
    pg.tensor_set(idt, np.array([[4, 0], [5, 3]], np.int32))
    sched.graph_compute(graph)
    got = pg.tensor_array(out).reshape(2, 2, m)
    for t, row in enumerate([[4, 0], [5, 3]]):
        for u, e in enumerate(row):
            assert np.array_equal(got[t, u], qmatmul.quant_matmul(raw[e], qtype, x[t])[0])


# runs of columns: a batch of several sequences, each computed as if alone (ops.mul_mat)
RUNS = [0, 1, 4, 13, 13, 22]  # columns of one token, a gemm four, 9 (tiled), an empty run, 9


@pytest.mark.parametrize("qtype", [Type.Q4_K, Type.Q5_K, Type.Q6_K, Type.Q4_0, Type.Q8_0, Type.F16, Type.F32],
                         ids=lambda t: t.name)
def test_each_run_of_columns_gets_the_bits_of_its_product_alone(qtype):
    """MUL_MAT with runs: each run's columns are the bits of a product of those columns alone,
    though the K-quants' kernels for the whole batch round otherwise (repacked Q4_K's gemm for
    whole fours of columns, the tiled kernels from 8): held here on 40 rows (Q4_K repacked) of
    256 elements, and with runs=None the batch's own kernels, as before."""
    k, m, n = 256, 40, RUNS[-1]
    w, _, _ = weight(qtype, m, k, seed=5)
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((n, k)).astype(np.float32)
    x = pg.new_tensor(Type.F32, (k, n), "x").set_input()
    runs = pg.new_tensor(Type.I32, (len(RUNS),), "runs").set_input()
    got = run_graph(ops.mul_mat(w, x, runs), {x: xv, runs: np.array(RUNS, np.int32)})[0, 0]
    for r0, r1 in zip(RUNS[:-1], RUNS[1:]):
        if r1 > r0:
            xr = pg.new_tensor(Type.F32, (k, r1 - r0), "xr").set_input()
            alone = run_graph(ops.mul_mat(w, xr), {xr: xv[r0:r1]})[0, 0]
            assert np.array_equal(got[r0:r1], alone), (qtype.name, r0, r1)
    whole = run_graph(ops.mul_mat(w, x), {x: xv})[0, 0]
    if qtype in (Type.Q4_K, Type.Q5_K, Type.Q6_K):  # runs are what makes the difference there
        assert not np.array_equal(got, whole)


@pytest.mark.parametrize("bad", [[1, 22], [0, 21], [0, 14, 9, 22], [0, 23]])
def test_runs_that_do_not_rise_from_0_to_the_columns_are_refused(bad):
    w, _, _ = weight(Type.Q4_K, 8, 256, seed=1)
    x = pg.new_tensor(Type.F32, (256, 22), "x").set_input()
    runs = pg.new_tensor(Type.I32, (len(bad),), "runs").set_input()
    with pytest.raises(ValueError, match="MUL_MAT: runs"):
        run_graph(ops.mul_mat(w, x, runs), {x: np.zeros((22, 256), np.float32), runs: np.array(bad, np.int32)})


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0"])
def test_mul_mat_id_with_runs_gives_each_run_its_bits_alone(name):
    """MUL_MAT_ID with runs of tokens: every run's rows are those of MUL_MAT_ID over that run's
    tokens alone (an expert's tokens of two sequences are two groups, not one)."""
    qtype, n_expert, m, k, n_used = Type[name], 4, 16, 256, 2
    runs = [0, 9, 10, 20]
    n_tokens = runs[-1]
    rng = np.random.default_rng(11)
    w, _ = experts(qtype, n_expert, m, k, rng)
    ids = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    ids[:, 0] = 1  # every token on expert 1: groups of 9, 1 and 10 when cut by the runs
    x = rng.standard_normal((n_tokens, 1, k)).astype(np.float32)

    def product(t0: int, t1: int, with_runs: bool) -> np.ndarray:
        b = pg.new_tensor(Type.F32, (k, 1, t1 - t0), "b").set_input()
        idt = pg.new_tensor(Type.I32, (n_used, t1 - t0), "ids").set_input()
        inputs = {b: x[t0:t1], idt: ids[t0:t1]}
        r = None
        if with_runs:
            r = pg.new_tensor(Type.I32, (len(runs),), "runs").set_input()
            inputs[r] = np.array(runs, np.int32)
        return run_graph(ops.mul_mat_id(w, b, idt, r), inputs).reshape(t1 - t0, n_used, m)
    got = product(0, n_tokens, True)
    for t0, t1 in zip(runs[:-1], runs[1:]):
        assert np.array_equal(got[t0:t1], product(t0, t1, False)), (name, t0, t1)


@pytest.mark.parametrize("qtype,m", [(Type.Q4_0, 40), (Type.Q4_1, 40), (Type.Q5_0, 40), (Type.Q5_1, 40),
                                     (Type.Q8_0, 40), (Type.Q4_K, 40), (Type.Q4_K, 38), (Type.Q5_K, 40),
                                     (Type.Q6_K, 40)], ids=lambda v: getattr(v, "name", str(v)))
def test_products_a_column_at_a_time_give_the_tiled_bits_and_take_the_tiled_rows_when_ready(qtype, m, monkeypatch):
    """On a new machine a model answers before its formats' tiled rows are compiled: until then
    its products take a column at a time (qdot.column_rows) through the format's slot, which
    tiles_ready then points at the tiled rows - calls made before (a plan's) run those from then
    on.  Every column's bits are the same either way: batches of every tile width and tail, with
    runs (whose columns take the K-quants' batch formats, repacked Q4_K's gemm at 40 rows)."""
    from pyggml.cpu import qdot
    from pyggml.cpu.activations import quantize
    from pyggml.cpu.kinds import VEC_DOT
    from pyggml.cpu.rows import PRODUCT, PRODUCT_BY_SLOT, Table
    monkeypatch.setattr(qdot, "_DEFERRED", set())
    monkeypatch.setattr(qdot, "_SLOTS", np.zeros_like(qdot._SLOTS))
    k = 512
    _, _, raw = weight(qtype, m, k, seed=7)
    fmt = int(qmatmul.product_format(qtype, m))
    rng = np.random.default_rng(9)
    for runs in ([0, 1], [0, 2], [0, 7], [0, 13], RUNS):
        n = runs[-1]
        acts = quantize(rng.standard_normal((n, k)).astype(np.float32), int(VEC_DOT[qtype]))
        runs = np.array(runs, np.int64)
        tiled = np.empty((n, m), np.float32)
        qdot.exact_quant_matmul(fmt, raw, *acts, tiled, runs)
        qdot.tiles_deferred(fmt)
        out = np.full((n, m), np.nan, np.float32)
        yb = np.empty((n, qdot.activation_bytes_width(k, qdot.lane_sums(fmt))), np.int8)
        calls = qdot.product_calls(fmt, raw, *acts, yb, out, runs)
        assert calls[-1].form == (PRODUCT if n == 1 else PRODUCT_BY_SLOT)  # (one column: always column_rows)
        table = Table(calls)
        table()
        assert np.array_equal(out, tiled), (qtype.name, runs.tolist())
        qdot.tiles_ready(fmt)
        assert qdot._SLOTS[fmt] == qdot.product_kernel(fmt).rows_at and fmt not in qdot._DEFERRED
        out[...] = np.nan
        table()  # the same calls, now the tiled rows
        assert np.array_equal(out, tiled), (qtype.name, runs.tolist())
        assert qdot.product_calls(fmt, raw, *acts, yb, out, runs)[-1].form == PRODUCT


BLOCK_WEIGHTS = [Type.Q4_0, Type.Q5_0, Type.Q8_0, Type.Q4_1, Type.Q5_1, Type.Q4_K, Type.Q5_K, Type.Q6_K]


@pytest.mark.parametrize("n_cols", [1, 3, 12], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("qtype", BLOCK_WEIGHTS, ids=lambda t: t.name)
def test_activations_sent_in_blocks_give_the_products_bits(qtype, n_cols):
    """A tensor split's gather (models/tensor_split.py): each device quantizes its rows of an
    activation to the weights' vec_dot type alone (ops.cast), the blocks are joined (ops.concat)
    and the product takes them as they are - bit for bit the product of the float activation,
    with runs of columns too; a cast is ggml's from_float, the blocks ggml's layout."""
    k, m = 512, 40  # (40 rows: Q4_K's repacked kernels)
    w, _, _ = weight(qtype, m, k, seed=3)
    kind = qtype.vec_dot_type
    xv = np.random.default_rng(2).standard_normal((n_cols, k)).astype(np.float32)
    xv[:, :32] *= 1e-3  # blocks of very different scales
    x = pg.new_tensor(Type.F32, (k, n_cols), "x").set_input()
    want = run_graph(ops.mul_mat(w, x), {x: xv})
    halves = [pg.new_tensor(Type.F32, (k // 2, n_cols), f"x{i}").set_input() for i in range(2)]
    blocks = ops.concat(ops.cast(halves[0], kind), ops.cast(halves[1], kind), 0)
    assert blocks.type == kind and blocks.ne[:2] == (k, n_cols)
    got = run_graph(ops.mul_mat(w, blocks), {halves[0]: xv[:, :k // 2], halves[1]: xv[:, k // 2:]})
    assert np.array_equal(got, want)
    runs = pg.new_tensor(Type.I32, (3,), "runs").set_input()
    cast = ops.cast(x, kind)
    split = run_graph(ops.mul_mat(w, cast, runs), {x: xv, runs: np.array([0, n_cols // 2, n_cols], np.int32)})
    assert np.array_equal(split, run_graph(ops.mul_mat(w, x, runs), {x: xv, runs: np.array([0, n_cols // 2, n_cols], np.int32)}))
    # the blocks are ggml's: its own dequantization reads them back to within a block's step
    values = run_graph(ops.cast(cast, Type.F32), {x: xv})[0, 0]
    assert np.abs(values - xv).max() <= np.abs(xv).max() / 127


def test_a_product_takes_only_its_own_blocks():
    w, _, _ = weight(Type.Q4_K, 8, 256, seed=1)
    x = pg.new_tensor(Type.F32, (256, 2), "x")
    with pytest.raises(ValueError, match="blocks the weights' products take"):
        ops.mul_mat(w, ops.cast(x, Type.Q8_0))  # Q4_K's products take Q8_K
    ops.mul_mat(w, ops.cast(x, Type.Q8_K))
    with pytest.raises(ValueError, match="cannot be cut into Q8_K blocks"):
        ops.cast(pg.new_tensor(Type.F32, (96, 2), "y"), Type.Q8_K)


def test_mul_mat_ids_route_grows_with_its_pairs_and_experts_not_its_runs():
    """A graph from the network sizes the runs: thousands of empty runs must not size the
    route's arrays (cpu/experts.py sorts by expert alone; runs stay in token order)."""
    from pyggml.cpu.experts import ExpertCalls, route_size
    from pyggml.cpu.qmatmul import QuantProduct
    n_expert, m, k, n_tokens, n_used = 6, 8, 64, 3, 2
    raw = np.zeros((n_expert, m, Type.Q8_0.row_size(k)), np.uint8)
    runs = np.array([0] * 5000 + [1, 3], np.int64)
    product = QuantProduct(raw[0], Type.Q8_0)
    calls = ExpertCalls(product.fmt, product.kind, raw, np.zeros((n_tokens, 1, k), np.float32),
                        np.zeros((n_tokens, n_used), np.int32), runs, np.zeros((n_tokens, n_used, m), np.float32))
    assert calls.route.size == route_size(n_tokens * n_used, n_expert) < 64

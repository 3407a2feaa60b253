"""The SIMD steps the CPU backend reproduces from ggml (pyggml/cpu/simd.py), against plain
numpy statements of what ggml's intrinsics compute."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from pyggml import Type
from pyggml.cpu.activations import quantize
from pyggml.cpu.kinds import VEC_DOT, Act
from pyggml.cpu.qmatmul import quant_matmul
from pyggml.cpu import nn
from pyggml.cpu.simd import expf_v, f16_dot16, f16_dot64, round_f16, silu_v, sum_lanes16, sum_lanes64
from pyggml.quants import quantize as quantize_weights
from pyggml.quants.layouts import LAYOUTS

f32, f64 = np.float32, np.float64


def fma(a, b, c):
    """float32 a * b + c rounded once (the product of two float32 is exact in double)."""
    return (np.asarray(a, f64) * np.asarray(b, f64) + np.asarray(c, f64)).astype(f32)


def hsum8(acc):
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))


def reduce16(v):
    """GCC's _mm512_reduce_add_ps: halves folded 16 -> 8 -> 4 -> 2 -> 1."""
    while v.size > 1:
        v = v[v.size // 2:] + v[:v.size // 2]
    return v[0]


def legacy_ints(qtype: Type, w: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 32-element format's rows as integers [M, K] (q - offset) and per-block d and m (0 without)."""
    blocks = w.reshape(-1).view(LAYOUTS[qtype]).reshape(w.shape[0], k // 32)
    d = blocks["d"].astype(f32)
    m = blocks["m"].astype(f32) if "m" in LAYOUTS[qtype].names else np.zeros_like(d)
    qs = blocks["qs"]
    if qtype == Type.Q8_0:
        return qs.view(np.int8).astype(np.int64).reshape(w.shape[0], k), d, m
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)  # element j, then 16 + j
    if qtype == Type.Q5_0:
        bits = (blocks["qh"][..., None] >> np.arange(32, dtype=np.uint32)) & 1
        q |= bits.astype(np.int64) << 4
    offset = {Type.Q4_0: 8, Type.Q5_0: 16, Type.Q4_1: 0}[qtype]
    return (q - offset).reshape(w.shape[0], k), d, m


def ggml_vec_dot_legacy(wq, wd, wm, yq, yd, ys) -> f32:
    """ggml's AVX2 vec_dot of one 32-element-format row and one Q8_0/Q8_1 column: per block 8
    lanes of 4-product integer sums, ``acc = fma(d_w * d_y, lanes, acc)``, then hsum8, plus the
    minimum's ``summs = fma(m_w, s_y, summs)``."""
    acc, summs = np.zeros(8, f32), f32(0.0)
    for b in range(wd.size):
        lanes = (wq[32 * b:32 * b + 32] * yq[32 * b:32 * b + 32].astype(np.int64)).reshape(8, 4).sum(1)
        acc = fma(f32(wd[b] * yd[b]), lanes.astype(f32), acc)
        summs = fma(wm[b], ys[b], summs)
    return f32(hsum8(acc) + summs) if wm.any() else f32(hsum8(acc))


def _each(fn):
    """A numba function applying the numba function fn to each element of an array."""
    @njit
    def each(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = fn(x[i])
        return out
    return each


_exp, _round, _silu = _each(expf_v), _each(round_f16), _each(silu_v)


@pytest.mark.parametrize("qtype", [Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q8_0])
def test_products_of_any_column_count_are_ggmls_vec_dot_per_column(qtype):
    """The block kernels take a column alone, or two or four at once (tiles, blockdot.py), and dot
    signed weights by an offset of the column's sums; every column still gets ggml's vec_dot."""
    rng = np.random.default_rng(int(qtype))
    k, m = 96, 7  # an odd row count: the last row is paired with itself
    w = quantize_weights(rng.standard_normal((m, k)).astype(f32), qtype)
    wq, wd, wm = legacy_ints(qtype, w, k)
    for n in (1, 2, 3, 5, 6, 9):
        x = (rng.standard_normal((n, k)) * 3).astype(f32)
        yq, yd, ys = quantize(x, int(VEC_DOT[qtype]))
        want = np.array([[ggml_vec_dot_legacy(wq[r], wd[r], wm[r], yq[c], yd[c], ys[c]) for r in range(m)]
                         for c in range(n)])
        got = quant_matmul(w, qtype, x)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qtype.name, n)


def test_round_f16_is_the_nearest_half_ties_to_even():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(20000).astype(f32) * f32(10.0) ** rng.integers(-9, 6, 20000),
                        np.array([0.0, -0.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e-8, 2.98e-8, 6.0e-8,
                                  1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, np.inf, -np.inf], f32)]).astype(f32)
    got = _round(x)
    with np.errstate(over="ignore"):  # numpy's cast says so when it rounds to infinity
        want = x.astype(np.float16).astype(f32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isnan(_round(np.array([np.nan], f32))[0])


def test_f16_dots_are_ggmls_and_tinyblas_accumulators():
    rng = np.random.default_rng(4)
    for d in (16, 64, 128, 256):
        k = rng.standard_normal(d).astype(np.float16)
        q = rng.standard_normal(d).astype(np.float16).astype(f32)
        if d % 64 == 0:  # ggml_vec_dot_f16: 4 x 16 lanes per step of 64, folded 0+2, 1+3
            acc = np.zeros((4, 16), f32)
            for o in range(0, d, 64):
                acc = fma(k[o:o + 64].astype(f32).reshape(4, 16), q[o:o + 64].reshape(4, 16), acc)
            assert _dot64(k.view(np.uint16), q) == reduce16((acc[0] + acc[2]) + (acc[1] + acc[3]))
        acc = np.zeros(16, f32)  # tinyBLAS: one 16-lane accumulator
        for o in range(0, d, 16):
            acc = fma(k[o:o + 16].astype(f32), q[o:o + 16], acc)
        assert _dot16(k.view(np.uint16), q) == reduce16(acc)


def test_lane_sums_fold_64_or_16_lanes_in_ggmls_order_and_zero_them():
    rng = np.random.default_rng(5)
    for single in (True, False):
        acc = rng.standard_normal((64, 48)).astype(f32)
        if not single:
            acc[16:] = 0.0
        a = acc.copy()
        if single:
            a = (a[:16] + a[32:48]) + (a[16:32] + a[48:])
        want = np.array([reduce16(a[:16, j]) for j in range(48)], f32)
        out = np.empty(48, f32)
        _lanes(acc, out, single)
        assert np.array_equal(out, want) and not acc.any()


@njit
def _dot64(k, q):
    return f16_dot64(k, q, q.size // 64)


@njit
def _dot16(k, q):
    return f16_dot16(k, q, q.size // 16)


@njit
def _lanes(acc, out, single):
    if single:
        sum_lanes64(acc, out, out.size // 16)
    else:
        sum_lanes16(acc, out, out.size // 16)


def test_ggml_expf_is_within_its_error_bound_and_saturates():
    x = np.linspace(-87, 88, 100001, dtype=f32)
    got = _exp(x)
    exact = np.exp(x.astype(f64))
    # ggml documents 1.45 ulp plus the final rounding; measured 2.17 near -47.5 (ulp of the result)
    assert np.all(np.abs(got - exact) <= 2.5 * np.spacing(exact.astype(f32)))
    assert _exp(np.array([0.0], f32))[0] == 1.0
    big = _exp(np.array([-200.0, 200.0, -np.inf], f32))
    assert big[0] == 0.0 and np.isinf(big[1]) and big[2] == 0.0


def test_silu_rows_in_and_out_of_exps_branch_free_range_are_ggml_v_silu():
    """SwiGLU takes expf's branch-free steps for rows within its normal range and expf_v's
    branches for the others (or a NaN): both must be ggml_v_silu, the tail the C library's."""
    rng = np.random.default_rng(6)
    rows = [np.linspace(-86, 86, 4099), rng.standard_normal(4099) * 30, np.linspace(-120, 120, 4099)]
    a = np.stack(rows).astype(f32)
    a[2, 7] = np.nan
    g = rng.standard_normal(a.shape).astype(f32)
    for n_rows in (1, 3):  # one row without the threads, several with
        out = np.empty_like(a[:n_rows])
        nn.swiglu(a[:n_rows], g[:n_rows], out)
        full = a.shape[1] - a.shape[1] % 16
        want = _silu(a[:n_rows, :full].reshape(-1)).reshape(n_rows, full) * g[:n_rows, :full]
        assert same_bits(out[:, :full], want)
        tail = a[:n_rows, full:]  # the C library's expf of a double, as the kernel's math.exp
        exp = np.exp(-tail.astype(f64)).astype(f32)
        assert same_bits(out[:, full:], tail / (f32(1.0) + exp) * g[:n_rows, full:])


@pytest.mark.parametrize("n", [200, 256])
def test_attention_softmax_over_the_cells_seen_is_the_rows_softmax(n):
    """Attention's softmax over the cells a row sees - the first m (a sequence's decoding
    step: one vectorized loop of expf's branch-free steps when every exponent is in its range)
    or any others - gives the bits of ggml's softmax over the whole row with the hidden cells
    at -inf, exponents past the branch-free range and the tail past the last 16 included."""
    rng = np.random.default_rng(11)
    for m in (1, 15, 16, 17, 100, 190, n):
        for spread in (3.0, 60.0):  # scores within expf's range, and some 100 below the maximum
            scores = (rng.standard_normal(n) * spread).astype(f32)
            for cells in (np.arange(m, dtype=np.int32), np.sort(rng.choice(n, m, replace=False)).astype(np.int32)):
                row = np.full(n, -np.inf, dtype=f32)
                row[cells] = scores[cells]
                want = row.copy()
                nn._softmax_row(want, f32(-np.inf))
                got = np.zeros(n, dtype=f32)
                got[cells] = scores[cells]
                nn._softmax_seen_call(got, n, cells, m, f32(-np.inf))
                assert same_bits(got, want), (m, spread)


def test_gelu_rows_read_ggmls_table_at_the_nearest_half():
    """GELU and GeGLU read the table of halves at F16(x), nearest with ties to even (x86's
    F16C conversion, as ggml's GGML_CPU_FP32_TO_FP16), for -10 < x < 10 - subnormal halves and
    ties included - 0 at or below -10, x at or above 10 or NaN; one row and several."""
    rng = np.random.default_rng(7)
    special = np.array([np.nan, np.inf, -np.inf, 10, -10, np.nextafter(f32(10), f32(0)),
                        np.nextafter(f32(-10), f32(0)), 1e-8, -1e-8, 6e-5, 2 ** -24, 2 ** -25, 3 * 2 ** -26,
                        1 + 2 ** -11, 1 + 3 * 2 ** -11, 65504, 1e30, -1e30, 0.0, -0.0], dtype=f32)
    x = np.concatenate([rng.standard_normal(4090).astype(f32) * 4, special[:6]])
    x = np.stack([x, np.roll(x, 7), rng.permutation(np.resize(special, x.size))]).astype(f32)
    table = nn.gelu_table()
    with np.errstate(over="ignore"):
        halves = x.astype(np.float16).view(np.uint16)
    want = np.where(x <= -10, f32(0), np.where((x >= 10) | np.isnan(x), x, table[halves])).astype(f32)
    g = rng.standard_normal(x.shape).astype(f32)
    for n_rows in (1, 3):  # one row without the threads, several with
        out = np.empty_like(x[:n_rows])
        nn.gelu(x[:n_rows], out)
        assert same_bits(out, want[:n_rows])
        nn.geglu(x[:n_rows], g[:n_rows], out)
        assert same_bits(out, want[:n_rows] * g[:n_rows])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(np.where(nan, 0, a).view(np.uint32),
                                                               np.where(nan, 0, b).view(np.uint32))


def test_q8_k_bsums_are_sums_of_16():
    x = np.random.default_rng(1).standard_normal((2, 512)).astype(f32)
    yq, yd, ys = quantize(x, int(Act.Q8_K))
    assert ys.shape == (2, 32)
    assert np.array_equal(ys, yq.reshape(2, 32, 16).sum(-1))
    assert np.all(np.abs(yq) <= 127) and np.array_equal(yq, np.rint(yq))


def test_attention_refuses_shapes_that_do_not_agree():
    """Attention's rows are a C function that takes the shapes it is given: an output, mask or
    cache that does not hold every row and cell it would touch is an error, not a stray write."""
    n_head, n_tok, d, cells = 4, 3, 64, 64
    q = np.ones((n_head, n_tok, d), dtype=np.float32)
    k = np.zeros((cells, 2 * d), dtype=np.uint16)  # 2 KV heads, F16 bits
    mask = np.zeros((n_tok, cells), dtype=np.float32)
    out = np.empty((n_tok, n_head, d), dtype=np.float32)
    nn.attention_cells(q, k, k, 2, mask, 0.125, 0.0, out)
    assert np.isfinite(out).all()
    for bad in [dict(out=np.empty((n_tok, n_head - 1, d), dtype=np.float32)),
                dict(mask=np.zeros((n_tok, cells + 64), dtype=np.float32)),  # cells the cache lacks
                dict(mask=np.zeros((n_tok - 1, cells), dtype=np.float32)),
                dict(v=np.zeros((cells, d), dtype=np.uint16))]:
        args = dict(q=q, k=k, v=k, n_head_kv=2, mask=mask, scale=0.125, softcap=0.0, out=out) | bad
        with pytest.raises(ValueError, match="do not agree"):
            nn.attention_cells(**args)


def test_attention_with_a_steps_row_cells_and_scratch_gives_the_same_bits():
    """A decoding step hands attention the mask's row cells it computed once and working arrays
    kept from call to call: the same bits as attention making its own, call after call (each
    row leaves its lanes' sums zeroed for the next), for masks of several widths over one
    scratch; row cells of another mask, or a scratch too small for the rows, are refused."""
    rng = np.random.default_rng(12)
    n_head, n_kv_heads, d, cells = 9, 3, 64, 256
    k = (rng.standard_normal((cells, n_kv_heads * d)) * 2).astype(np.float16).view(np.uint16)
    v = rng.standard_normal((cells, n_kv_heads * d)).astype(np.float16).view(np.uint16)
    scratch = nn.attention_scratch(2 * n_head, cells, d, d)
    for n_tok, width, seen in [(1, 64, 1), (1, 256, 200), (2, 192, 150), (1, 128, 128), (1, 64, 40)]:
        q = rng.standard_normal((n_head, n_tok, d)).astype(np.float32)
        mask = np.full((n_tok, width), -np.inf, dtype=np.float32)
        for t in range(n_tok):
            mask[t, :seen - n_tok + 1 + t] = 0.0
        want, got = (np.empty((n_tok, n_head, d), dtype=np.float32) for _ in range(2))
        nn.attention_cells(q, k, v, n_kv_heads, mask, 0.125, 0.0, want)
        for _ in range(2):
            nn.attention_cells(q, k, v, n_kv_heads, mask, 0.125, 0.0, got, nn.row_cells(mask), scratch)
            assert same_bits(got, want), (n_tok, width, seen)
    other = nn.row_cells(np.zeros((1, 128), dtype=np.float32))
    with pytest.raises(ValueError, match="do not agree"):
        nn.attention_cells(q, k, v, n_kv_heads, mask, 0.125, 0.0, got, other, scratch)
    with pytest.raises(ValueError, match="scratch"):
        nn.attention_cells(q, k, v, n_kv_heads, mask, 0.125, 0.0, got, None, nn.attention_scratch(n_head - 1, 64, d, d))
    with pytest.raises(ValueError, match="scratch"):
        nn.attention_cells(q, k, v, n_kv_heads, mask, 0.125, 0.0, got, None, nn.attention_scratch(n_head, 32, d, d))


def test_row_cells_and_seen_cells_of_a_batch_of_sequences():
    """What attention derives from a batch's mask, against the definitions read row by row: a
    sequence of three tokens (causal), one of a single token, and a row that sees nothing; the
    cells read end at the last one some row shows, in whole 64s."""
    mask = np.full((5, 192), -np.inf, dtype=np.float32)
    for t in range(3):  # sequence A: cells 0..9 before it, then its own tokens at 100..102
        mask[t, :10] = 0.0
        mask[t, 100:101 + t] = 0.0
    mask[3, 20:25] = -1.5  # sequence B's single token (a finite bias: shown)
    alone, n_seen, cells = nn.row_cells(mask)
    for t in range(5):
        shown = [c for c in range(192) if mask[t, c] != -np.inf]
        others = {c for u in range(5) if u != t for c in range(192) if mask[u, c] != -np.inf}
        assert n_seen[t] == len(shown) and cells[t, :len(shown)].tolist() == shown
        assert alone[t] == (not others.intersection(shown))
    assert alone.tolist() == [False, False, False, True, True]
    assert nn.seen_cells(mask) == 128  # the last shown cell is 102
    assert nn.seen_cells(mask[4:]) == 192  # no row shows a cell: all of them
    assert nn.seen_cells(mask[3:4]) == 64


def test_attention_rows_sharing_a_slot_of_the_scratch_give_the_same_bits():
    """Past 64 (head, token) rows, a chunk's rows share one slot of attention's working arrays,
    one after another: the same bits as each head's rows, a slot each."""
    rng = np.random.default_rng(5)
    n_head, n_kv_heads, d, n_tok, cells = 9, 3, 64, 12, 64
    k = (rng.standard_normal((cells, n_kv_heads * d)) * 2).astype(np.float16).view(np.uint16)
    v = rng.standard_normal((cells, n_kv_heads * d)).astype(np.float16).view(np.uint16)
    q = rng.standard_normal((n_head, n_tok, d)).astype(np.float32)
    mask = np.full((n_tok, cells), -np.inf, dtype=np.float32)
    for t in range(n_tok):
        mask[t, :40 + t] = 0.0
    assert nn.attention_scratch(n_head * n_tok, cells, d, d).shape[0] < n_head * n_tok  # slots shared
    got = np.empty((n_tok, n_head, d), dtype=np.float32)
    nn.attention_cells(q, k, v, n_kv_heads, mask, 0.125, 0.0, got)
    group = n_head // n_kv_heads
    for h in range(n_head):
        one = np.empty((n_tok, 1, d), dtype=np.float32)
        kv = slice(h // group * d, (h // group + 1) * d)
        nn.attention_cells(q[h:h + 1], k[:, kv], v[:, kv], 1, mask, 0.125, 0.0, one)
        assert same_bits(got[:, h:h + 1], one), h


def test_the_integer_dots_are_capped_by_pyggml_dots(monkeypatch):
    """PYGGML_DOTS caps the integer dot instructions the products compile to (the tests of the
    lesser paths use it); a name it does not know is an error, not a silent default."""
    import llvmlite.binding as llvm

    from pyggml.cpu.simd import integer_dots
    monkeypatch.delenv("PYGGML_DOTS", raising=False)
    own = integer_dots()
    if llvm.get_host_cpu_features().get("avx2"):
        assert own in ("vnni", "avx2")
    monkeypatch.setenv("PYGGML_DOTS", "plain")
    assert integer_dots() == "plain"
    monkeypatch.setenv("PYGGML_DOTS", "avx2")
    assert integer_dots() == ("avx2" if own != "plain" else "plain")
    monkeypatch.setenv("PYGGML_DOTS", "sse")
    with pytest.raises(ValueError, match="PYGGML_DOTS"):
        integer_dots()

"""The CPU backend's quantized products give llama.cpp's float32 bits.

tests/data/ggml_vec_dot.npz holds random weight blocks and activations and the results of
ggml's own ``quantize_row_q8_*`` + ``ggml_vec_dot_*`` on this kind of machine (written by
tools/ggml_vec_dot_data.py through llama-cpp-python).  The batched paths llama.cpp takes for
longer prompts (repacked Q4_K, tiled K-quants) are checked end to end by tests/models/test_models.py
against the reference logits.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pyggml as pg
from pyggml.cpu.qmatmul import quant_matmul
from pyggml.cpu.kinds import EXACT

DATA = np.load(Path(__file__).resolve().parents[1] / "data" / "ggml_vec_dot.npz")
TYPES = sorted({k.rsplit("_", 1)[0] for k in DATA.files}, key=lambda n: int(pg.Type[n]))


def test_every_exact_type_has_data():
    assert {pg.Type[n] for n in TYPES} == set(EXACT)


def test_mxfp4_with_an_odd_block_count_equals_ggml():
    """An odd number of blocks ends with ggml's scalar step (the data file's rows are even):
    checked against the ggml CPU library ../shared/bin/build-llamacpp builds, where it is."""
    import ctypes
    import os
    from pyggml.cpu.activations import quantize
    from pyggml.cpu.kinds import Act
    lib_path = os.path.expanduser("~/.cache/llama.cpp-ref/build/bin/libggml-cpu.so")
    if not os.path.exists(lib_path):
        pytest.skip(f"llama.cpp's ggml CPU library is not built here ({lib_path}): run ../shared/bin/build-llamacpp")
    lib = ctypes.CDLL(lib_path)
    lib.ggml_cpu_init()
    rng = np.random.default_rng(3)
    k = 17 * 32
    w = rng.integers(0, 256, (6, 17 * 17), dtype=np.uint8)
    w.reshape(6, 17, 17)[:, :, 0] = rng.integers(115, 130, (6, 17))
    x = (rng.standard_normal((2, k)) * 3).astype(np.float32)
    got = quant_matmul(w, pg.Type.MXFP4, x)
    P = ctypes.c_void_p
    for n in range(2):
        y = np.zeros(17 * 34, np.uint8)
        lib.quantize_row_q8_0(x[n].ctypes.data_as(P), y.ctypes.data_as(P), ctypes.c_int64(k))
        for m in range(6):
            s = ctypes.c_float()
            row = np.ascontiguousarray(w[m])
            lib.ggml_vec_dot_mxfp4_q8_0(ctypes.c_int(k), ctypes.byref(s), ctypes.c_size_t(0), row.ctypes.data_as(P),
                                        ctypes.c_size_t(0), y.ctypes.data_as(P), ctypes.c_size_t(0), ctypes.c_int(1))
            assert got[n, m] == np.float32(s.value), (n, m, got[n, m], s.value)
    assert quantize  # (the activations ggml quantizes are ours: quant_matmul quantizes them the same way)
    assert Act.Q8_0


@pytest.mark.parametrize("name", TYPES)
def test_vec_dot_bits_equal_ggml(name):
    w, x, want = DATA[name + "_w"], DATA[name + "_x"], DATA[name + "_out"]
    qtype = pg.Type[name]
    if qtype == pg.Type.Q4_K:
        w = w[:-1]  # a row count that is not a multiple of 8: ggml's plain vec_dot, not the repacked kernel
        want = want[:, :-1]
    got = quant_matmul(w, qtype, x)  # 3 columns: the single-vector path (tiled matmul starts at 8)
    assert got.dtype == np.float32
    assert np.array_equal(got, want), f"{name}: {(got != want).sum()} of {want.size} differ, " \
        f"max relative {np.abs(got - want).max() / np.abs(want).max():.2g}"


LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # one vec_dot formula for any number of columns


@pytest.mark.parametrize("name", LEGACY)
def test_batched_columns_equal_single_columns(name):
    """Batches go through blockdot's tiles (two rows with four or two columns at once, signed
    weights dotted from an offset); for these types ggml's batched arithmetic is its vec_dot, so
    every column must equal its own (9 columns: two tiles of four and a single one)."""
    w, x = DATA[name + "_w"], DATA[name + "_x"]
    qtype = pg.Type[name]
    xs = np.concatenate([x, x[::-1], x * np.float32(0.5)])  # 9 columns
    batched = quant_matmul(w, qtype, xs)
    single = np.concatenate([quant_matmul(w, qtype, xs[i:i + 1]) for i in range(len(xs))])
    assert np.array_equal(batched, single)


def _fma(a, b, c):
    """fmaf through float64: the product of two float32 values is exact there; the sum is
    rounded twice (to 53 bits, then 24), which differs from one rounding too rarely to meet."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _q6_k_ints(row: np.ndarray):
    """A Q6_K row's unsigned 6-bit codes [blocks, 256], 16-value scales [blocks, 16] and d."""
    b = row.reshape(-1, 210).astype(np.int64)
    q = np.empty((len(b), 256), dtype=np.int64)
    for half in range(2):
        ql, qh = b[:, 64 * half:64 * half + 64], b[:, 128 + 32 * half:160 + 32 * half]
        for plane in range(4):
            lo = (ql[:, 32 * (plane % 2):32 * (plane % 2) + 32] >> (4 * (plane // 2))) & 15
            q[:, 128 * half + 32 * plane:128 * half + 32 * plane + 32] = lo | (((qh >> (2 * plane)) & 3) << 4)
    return q, row.reshape(-1, 210)[:, 192:208].view(np.int8).astype(np.int64), _halves(row.reshape(-1, 210), 208)


def _q4_k_ints(row: np.ndarray, five: bool = False):
    """A Q4_K (Q5_K) row's 4-bit (5-bit) codes [blocks, 256], sub-block scales and mins
    [blocks, 8], d, dmin."""
    blocks = row.reshape(-1, 176 if five else 144)
    b = blocks.astype(np.int64)
    sc, mn = b[:, 4:16], np.empty((len(b), 8), dtype=np.int64)
    scales = np.empty_like(mn)
    scales[:, :4], mn[:, :4] = sc[:, 0:4] & 63, sc[:, 4:8] & 63
    scales[:, 4:] = (sc[:, 8:12] & 15) | ((sc[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    q = np.empty((len(b), 256), dtype=np.int64)
    qs = 48 if five else 16
    for pair in range(4):
        packed = b[:, qs + 32 * pair:qs + 32 + 32 * pair]
        q[:, 64 * pair:64 * pair + 32], q[:, 64 * pair + 32:64 * pair + 64] = packed & 15, packed >> 4
    if five:  # bit s of qh[l]: the fifth bit of value l of sub-block s
        for sub in range(8):
            q[:, 32 * sub:32 * sub + 32] |= ((b[:, 16:48] >> sub) & 1) << 4
    return q, scales, mn, _halves(blocks, 0), _halves(blocks, 2)


def test_batched_k_quant_products_follow_llama_cpps_float_steps():
    """blockdot.py's batch formats against a plain numpy reference: Q6_K, Q4_K and Q5_K from 8
    columns (the tiled matmul: ``r = float(s) * d_w`` (``r = fma(-dmin_w, float(mins), r)``),
    ``acc = fma(r, d_y, acc)`` per block) and repacked Q4_K for columns in fours
    (ggml_gemm_q4_K_8x8_q8_K: the scales' and the mins' integers of each pair of sub-blocks
    into two accumulators)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 512)).astype(np.float32) * rng.uniform(0.2, 3, (8, 1)).astype(np.float32)
    _check_batched_k_quants(x, {name: DATA[name + "_w"] for name in ("Q6_K", "Q4_K", "Q5_K")})


def _extreme_k_quant_rows(name: str, rows: int, k: int) -> np.ndarray:
    """Rows of ``name`` whose every code, scale and min is at its largest (Q6_K's scales at
    -128 and 127 in turn), with small finite d and dmin: the largest integers the products'
    16-bit steps (vpmaddubsw's pair sums, vpmaddwd by the scales) ever hold."""
    size = {"Q6_K": 210, "Q4_K": 144, "Q5_K": 176}[name]
    blocks = np.full((rows, k // 256, size), 0xFF, dtype=np.uint8)
    small = np.frombuffer(np.array([1e-3, 2e-3], dtype=np.float16).tobytes(), dtype=np.uint8)
    if name == "Q6_K":
        blocks[:, :, 192:208] = np.tile(np.array([0x80, 0x7F], dtype=np.uint8), 8)
        blocks[:, :, 208:210] = small[:2]
    else:
        blocks[:, :, 0:4] = small
    return blocks.reshape(rows, -1)


def test_batched_k_quant_products_hold_their_largest_integers():
    """The same reference with every weight code, scale and min at its largest and activations
    at Q8_K's extremes (+-127): no 16-bit step of the integer dots saturates."""
    rng = np.random.default_rng(9)
    x = np.where(rng.random((8, 512)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[:, ::7] *= 0.999
    assert set(np.unique(_q8_k_values(x))) >= {-127, 127}
    _check_batched_k_quants(x, {name: _extreme_k_quant_rows(name, 16, 512) for name in ("Q6_K", "Q4_K", "Q5_K")})


def _q8_k_values(x: np.ndarray) -> np.ndarray:
    from pyggml.cpu.activations import quantize
    from pyggml.cpu.kinds import Act
    return quantize(x, int(Act.Q8_K))[0].astype(np.int64)


def _check_batched_k_quants(x: np.ndarray, weights: dict[str, np.ndarray]) -> None:
    from pyggml.cpu.activations import quantize
    from pyggml.cpu.kinds import Act
    yq, yd, bsums = quantize(x, int(Act.Q8_K))
    y = yq.astype(np.int64).reshape(8, -1, 256)
    bs = bsums.astype(np.int64).reshape(8, -1, 16)

    w = weights["Q6_K"]
    got = quant_matmul(w, pg.Type.Q6_K, x)
    for m in range(len(w)):
        q, scales, d = _q6_k_ints(w[m])
        for n in range(8):
            s = (q * np.repeat(scales, 16, axis=1) * y[n]).sum(1) - 32 * (scales * bs[n]).sum(1)
            acc = np.float32(0)
            for b in range(len(s)):
                acc = _fma(np.float32(s[b]) * d[b], yd[n, b], acc)
            assert got[n, m] == acc, f"Q6_K row {m} column {n}"

    w = weights["Q4_K"]
    assert len(w) % 8 == 0  # repacked
    got = quant_matmul(w, pg.Type.Q4_K, x)
    for m in range(len(w)):
        q, scales, mins, d, dmin = _q4_k_ints(w[m])
        for n in range(8):
            subs = (q * y[n]).reshape(-1, 8, 32).sum(2) * scales
            min_terms = mins * bs[n].reshape(-1, 8, 2).sum(2)
            acc = acc_min = np.float32(0)
            for b in range(len(subs)):
                for pair in range(4):
                    acc = _fma(np.float32(subs[b, 2 * pair:2 * pair + 2].sum()), d[b] * yd[n, b], acc)
                    acc_min = _fma(np.float32(min_terms[b, 2 * pair:2 * pair + 2].sum()), dmin[b] * yd[n, b], acc_min)
            assert got[n, m] == acc - acc_min, f"Q4_K row {m} column {n}"

    for name in ("Q4_K", "Q5_K"):  # rows not in whole eights, and Q5_K: the tiled matmul
        w = weights[name][:15]
        got = quant_matmul(w, pg.Type[name], x)
        for m in range(len(w)):
            q, scales, mins, d, dmin = _q4_k_ints(w[m], five=name == "Q5_K")
            for n in range(8):
                s1 = ((q * y[n]).reshape(-1, 8, 32).sum(2) * scales).sum(1)
                s2 = (mins * bs[n].reshape(-1, 8, 2).sum(2)).sum(1)
                acc = np.float32(0)
                for b in range(len(s1)):
                    r = _fma(-dmin[b], np.float32(s2[b]), np.float32(s1[b]) * d[b])
                    acc = _fma(r, yd[n, b], acc)
                assert got[n, m] == acc, f"{name} row {m} column {n}"


def _columns(x: np.ndarray, batch: bool) -> np.ndarray:
    return np.concatenate([x] * 3) if batch else x[:1]


@pytest.mark.parametrize("level", ["avx2", "plain"])
def test_every_level_of_integer_dots_gives_the_same_bits(tmp_path, level):
    """The integer dots of a CPU with fewer instructions (simd.DOT_LEVELS: AVX2's vpmaddubsw
    where there is no VNNI, plain vector IR where there is no AVX2; signed weights by their lane
    sums or the sign trick; MXFP4's table by AVX2's byte shuffle or in arithmetic) give the same bits as this CPU's, for batches (blockdot's tiles) and
    single columns: run in a process of its own with PYGGML_DOTS=level and its own numba cache."""
    import os
    import subprocess
    import sys

    from pyggml.cpu.simd import DOT_LEVELS, integer_dots
    if DOT_LEVELS.index(level) <= DOT_LEVELS.index(integer_dots()):
        pytest.skip(f"this CPU's own integer dots are {integer_dots()!r}: the tests of its own path check them")
    code = ("import numpy as np, sys; import pyggml as pg; from pyggml.cpu.qmatmul import quant_matmul;"
            "from pyggml.cpu.blockdot import DOTS; assert DOTS == sys.argv[3], DOTS;"
            "d = np.load(sys.argv[1]); out = {}\n"
            "for n in ('Q4_0', 'Q8_0', 'Q4_1', 'Q5_0', 'Q4_K', 'Q6_K', 'MXFP4'):\n"
            "    for batch in (True, False):\n"
            "        x = np.concatenate([d[n + '_x']] * 3) if batch else d[n + '_x'][:1]\n"
            "        out[f'{n}_{batch}'] = quant_matmul(d[n + '_w'], pg.Type[n], x)\n"
            "np.savez(sys.argv[2], **out)")
    env = dict(os.environ, PYGGML_DOTS=level, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[1] / "data" / "ggml_vec_dot.npz"),
                    str(tmp_path / "out.npz"), level], check=True, env=env, timeout=600)
    other = np.load(tmp_path / "out.npz")
    assert len(other.files) == 14
    for key in other.files:
        n, batch = key.rsplit("_", 1)[0], key.endswith("True")
        here = quant_matmul(DATA[n + "_w"], pg.Type[n], _columns(DATA[n + "_x"], batch))
        assert np.array_equal(other[key], here), key

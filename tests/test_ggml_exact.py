"""The CPU backend's quantized products give llama.cpp's float32 bits.

tests/data/ggml_vec_dot.npz holds random weight blocks and activations and the results of
ggml's own ``quantize_row_q8_*`` + ``ggml_vec_dot_*`` on this kind of machine (written by
tools/ggml_vec_dot_data.py through llama-cpp-python).  The batched paths llama.cpp takes for
longer prompts (repacked Q4_K, tiled K-quants) are checked end to end by tests/test_models.py
against the reference logits.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pyggml as pg
from pyggml.cpu.qmatmul import quant_matmul
from pyggml.cpu.qdot import EXACT

DATA = np.load(Path(__file__).parent / "data" / "ggml_vec_dot.npz")
TYPES = sorted({k.rsplit("_", 1)[0] for k in DATA.files}, key=lambda n: int(pg.Type[n]))


def test_every_exact_type_has_data():
    assert {pg.Type[n] for n in TYPES} == set(EXACT)


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
    """From 4 columns the lane sums are 8-bit integer dot products (simd.lane_dots); for these
    types ggml's batched arithmetic is its vec_dot, so every column must equal its own."""
    w, x = DATA[name + "_w"], DATA[name + "_x"]
    qtype = pg.Type[name]
    xs = np.concatenate([x, x[::-1], x * np.float32(0.5)])  # 9 columns
    batched = quant_matmul(w, qtype, xs)
    single = np.concatenate([quant_matmul(w, qtype, xs[i:i + 1]) for i in range(len(xs))])
    assert np.array_equal(batched, single)


def test_decode_step_kernels_equal_the_unpacking_path():
    """Single columns of Q6_K and of Q4_K in rows of whole eights (llama.cpp's repacked gemv)
    come from blockdot.py; batches of 4 to 7 columns unpack the rows and use the same float
    steps (Q6_K for every column, repacked Q4_K for the columns after the last whole four)."""
    rng = np.random.default_rng(3)
    for name in ("Q4_K", "Q6_K"):
        w, x = DATA[name + "_w"], DATA[name + "_x"]
        qtype = pg.Type[name]
        assert qtype != pg.Type.Q4_K or len(w) % 8 == 0
        xs = np.concatenate([x, x[::-1] * np.float32(0.7)])[:5] * rng.uniform(0.5, 2, (5, 1)).astype(np.float32)
        batched = quant_matmul(w, qtype, xs)
        checked = range(5) if name == "Q6_K" else [4]
        for n in checked:
            single = quant_matmul(w, qtype, xs[n:n + 1])[0]
            assert np.array_equal(batched[n], single), f"{name} column {n}: {(batched[n] != single).sum()} differ"


def _columns(x: np.ndarray, batch: bool) -> np.ndarray:
    return np.concatenate([x] * 3) if batch else x[:1]


def test_portable_lane_dots_equal_vnni(tmp_path):
    """The plain-IR integer dots (CPUs without AVX-512 VNNI) give the same bits, for batches
    (simd.lane_dots) and single columns (blockdot.py): run in a process of its own with
    PYGGML_NO_VNNI=1 and its own numba cache."""
    import os
    import subprocess
    import sys
    code = ("import numpy as np, sys; import pyggml as pg; from pyggml.cpu.qmatmul import quant_matmul;"
            "d = np.load(sys.argv[1]); out = {}\n"
            "for n in ('Q4_0', 'Q8_0', 'Q4_1', 'Q5_0', 'Q4_K', 'Q6_K'):\n"
            "    for batch in (True, False):\n"
            "        x = np.concatenate([d[n + '_x']] * 3) if batch else d[n + '_x'][:1]\n"
            "        out[f'{n}_{batch}'] = quant_matmul(d[n + '_w'], pg.Type[n], x)\n"
            "np.savez(sys.argv[2], **out)")
    env = dict(os.environ, PYGGML_NO_VNNI="1", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent / "data" / "ggml_vec_dot.npz"),
                    str(tmp_path / "out.npz")], check=True, env=env, timeout=600)
    portable = np.load(tmp_path / "out.npz")
    assert len(portable.files) == 12
    for key in portable.files:
        n, batch = key.split("_")[0] + "_" + key.split("_")[1], key.endswith("True")
        here = quant_matmul(DATA[n + "_w"], pg.Type[n], _columns(DATA[n + "_x"], batch))
        assert np.array_equal(portable[key], here), key

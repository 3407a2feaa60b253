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

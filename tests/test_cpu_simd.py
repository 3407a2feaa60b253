"""The SIMD steps the CPU backend reproduces from ggml (pyggml/cpu/simd.py), against plain
numpy statements of what ggml's intrinsics compute."""
from __future__ import annotations

import numpy as np
from numba import njit

from pyggml.cpu.activations import quantize
from pyggml.cpu.kinds import Act
from pyggml.cpu.simd import expf_v, lane_chain8

f32, f64 = np.float32, np.float64


@njit
def _chain(S, wd, yd):
    return lane_chain8(S, wd, yd, wd.size)


@njit
def _exp(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = expf_v(x[i])
    return out


def test_lane_chain_is_eight_fused_accumulators_then_hsum8():
    rng = np.random.default_rng(0)
    for nb in (0, 1, 7, 40):
        S = rng.integers(-60000, 60000, 8 * nb).astype(f32)
        wd = rng.random(nb).astype(f32)
        yd = (rng.random(nb) * 1e-3).astype(f32)
        acc = np.zeros(8, f32)
        for b in range(nb):
            scale = f32(wd[b] * yd[b])
            # one rounding per fma: the product is exact in double, the sum rounds once
            acc = (f64(scale) * S[8 * b:8 * b + 8].astype(f64) + acc.astype(f64)).astype(f32)
        want = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
        assert _chain(S, wd, yd) == want


def test_ggml_expf_is_within_its_error_bound_and_saturates():
    x = np.linspace(-87, 88, 100001, dtype=f32)
    got = _exp(x)
    exact = np.exp(x.astype(f64))
    # ggml documents 1.45 ulp plus the final rounding; measured 2.17 near -47.5 (ulp of the result)
    assert np.all(np.abs(got - exact) <= 2.5 * np.spacing(exact.astype(f32)))
    assert _exp(np.array([0.0], f32))[0] == 1.0
    big = _exp(np.array([-200.0, 200.0, -np.inf], f32))
    assert big[0] == 0.0 and np.isinf(big[1]) and big[2] == 0.0


def test_q8_k_bsums_are_sums_of_16():
    x = np.random.default_rng(1).standard_normal((2, 512)).astype(f32)
    yq, yd, ys = quantize(x, int(Act.Q8_K))
    assert ys.shape == (2, 32)
    assert np.array_equal(ys, yq.reshape(2, 32, 16).sum(-1))
    assert np.all(np.abs(yq) <= 127) and np.array_equal(yq, np.rint(yq))

"""The CUDA sources under kernels/, checked without a GPU.

Every kernel source must compile with nvcc for sm_80 and sm_90 (these machines have nvcc;
the test skips only where it is absent).  The kernels then run in the CUDA emulator
(tests/cuda/emulator.py: the kernels' own code, every thread a fiber, shuffles and barriers
as on a GPU) against pyggml's CPU formats, on shapes chosen to hit their edges: row counts
that do not fill a thread block, rows of fewer groups than a warp has lanes and of more,
padded row strides, every column count a matrix-vector launch takes.  On a GPU,
tests/cuda/test_cuda.py runs them for real.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import pyggml as pg
from pyggml.cuda.kernels import QUANT_KERNELS as CUDA_QUANT_KERNELS
from pyggml.cuda.kernels import mmvq_shape
from pyggml.quants.layouts import LAYOUTS

from tests.cuda import emulator

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
needs_emulator = pytest.mark.skipif(not emulator.available, reason="no C++ compiler for the CUDA emulator")

QUANT_KERNELS = {qtype.name: kernel for qtype, kernel in CUDA_QUANT_KERNELS.items()}
WEIGHT_TYPES = list(QUANT_KERNELS)
Q8_1 = np.dtype([("d", "<f2"), ("s", "<f2"), ("q", "i1", 32)])


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", sorted(p.name for p in KERNELS.glob("*.cu")))
def test_kernel_compiles(source, arch, tmp_path):
    r = subprocess.run([NVCC, f"-arch={arch}", "-c", "-o", str(tmp_path / "k.o"), str(KERNELS / source)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr


def random_weights(qtype: pg.Type, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks with finite, modest f16 scales: every bit pattern of the quants occurs."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=rows * qtype.row_size(cols), dtype=np.uint8)
    blocks = raw.view(LAYOUTS[qtype])
    for field in ("d", "m", "dmin"):
        if field in blocks.dtype.names:
            blocks[field] = rng.uniform(-0.05, 0.05, size=blocks.shape).astype(np.float16)
    if "e" in blocks.dtype.names:  # MXFP4's E8M0 exponents: scales of 2^-10 .. 2^-4
        blocks["e"] = rng.integers(118, 125, size=blocks.shape)
    return raw.reshape(rows, -1)


def padded(rows: np.ndarray, extra: int) -> np.ndarray:
    """The same rows with `extra` junk bytes after each: a strided view, as a tensor's rows can be."""
    out = np.full((rows.shape[0], rows.shape[1] + extra), 0xAB, np.uint8)
    out[:, :rows.shape[1]] = rows
    return out[:, :rows.shape[1]]


def q8_1_reference(x: np.ndarray) -> np.ndarray:
    """Activations to q8_1 blocks as kernels/quantize.cu defines them: d = max|x| / 127,
    q = round half to even (x / d), s = d * sum(q), d and s stored as f16."""
    g = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(g).max(axis=-1) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(d[..., None] == 0, 0, np.rint(g / d[..., None])).astype(np.int32)
    out = np.zeros(g.shape[:2], Q8_1)
    out["d"], out["s"], out["q"] = d.astype(np.float16), (d * q.sum(-1).astype(np.float32)).astype(np.float16), q
    return out.view(np.uint8).reshape(x.shape[0], -1)


def quantize(x: np.ndarray) -> np.ndarray:
    n, k = x.shape
    groups = k // 32
    xq = np.zeros((n, groups * 36), np.uint8)
    emulator.function("quantize.cu", "quantize_q8_1")(((groups * n + 7) // 8,), (256,), (
        x, xq, np.int64(k), np.int64(x.strides[0] // 4), np.int64(groups * 36), np.int64(n)))
    return xq


@needs_emulator
@pytest.mark.parametrize("name", WEIGHT_TYPES)
@pytest.mark.parametrize("out_type", ["f32", "f16"])
def test_dequantize_kernels_match_the_cpu_formats(name, out_type):
    qtype = pg.Type[name]
    rows, cols = 7, 768
    w = padded(random_weights(qtype, rows, cols), 6)
    dtype = np.float32 if out_type == "f32" else np.float16
    y = np.zeros((rows, cols + 32), dtype)  # output rows padded too: y_stride > cols
    emulator.function("dequantize.cu", f"dequantize_{QUANT_KERNELS[name]}_{out_type}")(
        ((rows * cols // 32 * 4 + 255) // 256,), (256,),
        (w, y, np.int64(cols // 32), np.int64(rows), np.int64(w.strides[0]), np.int64(cols + 32)))
    want = pg.quants.dequantize(np.ascontiguousarray(w), qtype).reshape(rows, cols)
    np.testing.assert_array_equal(y[:, :cols], want.astype(dtype))
    assert (y[:, cols:] == 0).all()


@needs_emulator
def test_quantize_q8_1_matches_the_format():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 40 * 32)).astype(np.float32) * 3
    x[1, :32] = 0                  # an all-zero block: d = 0, q = 0
    x[2, 32:64] = np.float32(0.5)  # exact halves of d: rounding ties
    x[2, 32] = 63.5
    np.testing.assert_array_equal(quantize(x), q8_1_reference(x))


# a warp takes 8 groups per step, a block (4 warps on one row) 32: some warps idle, a whole step
# and a partial one, two whole steps and a partial one, and (legacy types, whose rows need not
# be whole 256-element super-blocks) a warp's partial step
MMVQ_CASES = [(name, groups) for name in WEIGHT_TYPES for groups in (8, 40, 72, *((18,) if "K" not in name else ()))]


@needs_emulator
@pytest.mark.parametrize("name, groups", MMVQ_CASES)
def test_mul_mat_vec_kernels(name, groups):
    """Each row's product with every column count a launch takes (1..8; 1 also by the
    single-column variant), padded weight rows and output columns: within f32 rounding of
    the same product computed from the q8_1 activations, and close to the exact product."""
    qtype = pg.Type[name]
    rows, k = 37, groups * 32
    w = padded(random_weights(qtype, rows, k, seed=groups), 10)
    values = pg.quants.dequantize(np.ascontiguousarray(w), qtype).reshape(rows, k).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((8, k)).astype(np.float32)
    xq = quantize(x)
    blocks = xq.view(Q8_1).reshape(8, groups)
    x_seen = (blocks["q"].astype(np.float64) * blocks["d"].astype(np.float64)[..., None]).reshape(8, k)
    kernel = f"mul_mat_vec_{QUANT_KERNELS[name]}"
    for n, fn in [(1, emulator.function("mmvq.cu", kernel + "_1"))] + \
            [(n, emulator.function("mmvq.cu", kernel)) for n in range(1, 9)]:  # one column: its own variant too
        dst = np.full((n, rows + 3), np.nan, np.float32)
        fn(*mmvq_shape(rows), (w, xq, dst, np.int32(groups), np.int32(rows), np.int64(w.strides[0]), np.int32(n),
                                np.int64(xq.strides[0]), np.int64(rows + 3)))
        got = dst[:, :rows]
        scale = np.abs(x_seen[:n]) @ np.abs(values).T  # what rounding errors are relative to
        assert (np.abs(got - x_seen[:n] @ values.T) <= 2e-3 * scale + 1e-6).all(), n
        exact = x[:n].astype(np.float64) @ values.T
        assert np.sum((got - exact) ** 2) / np.sum(exact ** 2) < 5e-4
        assert np.isnan(dst[:, rows:]).all()  # nothing written past the rows


@needs_emulator
@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_mul_mat_vec_with_activations_whose_block_sums_overflow_f16(name):
    """Activations near 20000 (FFN outputs reach such values): a q8_1 block's F16 sum d*sum(q)
    is inf, so the weights' offset term must come from the quants themselves."""
    qtype, rows, groups = pg.Type[name], 8, 8
    w = random_weights(qtype, rows, groups * 32, seed=7)
    values = pg.quants.dequantize(w, qtype).reshape(rows, -1).astype(np.float64)
    x = (20000 + 500 * np.random.default_rng(5).standard_normal((1, groups * 32))).astype(np.float32)
    xq = quantize(x)
    assert np.isinf(xq.view(Q8_1)["s"].astype(np.float32)).all()  # the case this test is about
    dst = np.zeros((1, rows), np.float32)
    emulator.function("mmvq.cu", f"mul_mat_vec_{QUANT_KERNELS[name]}_1")(*mmvq_shape(rows), (
        w, xq, dst, np.int32(groups), np.int32(rows), np.int64(w.strides[0]), np.int32(1), np.int64(xq.strides[0]),
        np.int64(rows)))
    exact = x.astype(np.float64) @ values.T
    assert np.isfinite(dst).all()
    assert np.sum((dst - exact) ** 2) / np.sum(exact ** 2) < 5e-4


def test_compile_errors_name_the_file_and_line():
    from pyggml.cuda.runtime import compile_error_message
    log = '/tmp/tmpab12/e7c1.cu(57): error: identifier "acc" is undefined\n1 error detected'
    assert compile_error_message("mmvq.cu", log).startswith("CUDA kernel kernels/mmvq.cu:57 failed to compile")
    log = '/work/kernels/common.cuh(120): error: expected a ";"'
    assert compile_error_message("mmvq.cu", log).startswith("CUDA kernel kernels/common.cuh:120 failed")

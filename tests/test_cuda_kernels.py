"""The CUDA sources under kernels/, checked without a GPU.

Every kernel source must compile with nvcc for sm_80 and sm_90 (these machines have nvcc;
the test skips only where it is absent).  The weight-format decoders that the kernels share
(kernels/common.cuh) are also built into a host library and compared with pyggml's CPU
formats, and so is the arithmetic of the q8_1 matrix-vector product.  Running the kernels
themselves needs a GPU: tests/test_cuda.py.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import pyggml as pg
from pyggml.quants.layouts import LAYOUTS

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")

WEIGHT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", sorted(p.name for p in KERNELS.glob("*.cu")))
def test_kernel_compiles(source, arch, tmp_path):
    r = subprocess.run([NVCC, f"-arch={arch}", "-c", "-o", str(tmp_path / "k.o"), str(KERNELS / source)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not installed on this machine")
    lib = tmp_path_factory.mktemp("harness") / "harness.so"
    r = subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", "-I", str(KERNELS), "-o", str(lib),
                        str(ROOT / "tests" / "cuda" / "host_harness.cu")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    h = ctypes.CDLL(str(lib))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    h.dequantize_rows.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    h.mul_mat_vec.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr]
    return h


def random_weights(qtype: pg.Type, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks with finite, modest f16 scales: every bit pattern of the quants occurs."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=rows * qtype.row_size(cols), dtype=np.uint8)
    blocks = raw.view(LAYOUTS[qtype])
    for field in ("d", "m", "dmin"):
        if field in blocks.dtype.names:
            blocks[field] = rng.uniform(-0.05, 0.05, size=blocks.shape).astype(np.float16)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_decoders_match_the_cpu_formats(harness, name):
    qtype = pg.Type[name]
    rows, cols = 6, 512
    w = random_weights(qtype, rows, cols)
    got = np.empty((rows, cols), dtype=np.float32)
    harness.dequantize_rows(int(qtype), w.ctypes.data, rows, cols // 32, w.shape[1], got.ctypes.data)
    want = pg.quants.dequantize(w, qtype).reshape(rows, cols)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_q8_1_dot_products(harness, name):
    """The kernel's per-group arithmetic (integer dot, then a * dx * dot + b * s) against the
    exact product: within what rounding the activations to 8 bits costs."""
    qtype = pg.Type[name]
    rows, cols = 64, 1024
    w = random_weights(qtype, rows, cols, seed=1)
    x = np.random.default_rng(2).standard_normal(cols).astype(np.float32)
    got = np.empty(rows, dtype=np.float32)
    harness.mul_mat_vec(int(qtype), w.ctypes.data, rows, cols // 32, w.shape[1], x.ctypes.data, got.ctypes.data)
    want = pg.quants.dequantize(w, qtype).reshape(rows, cols).astype(np.float64) @ x.astype(np.float64)
    nmse = np.sum((got - want) ** 2) / np.sum(want ** 2)
    assert nmse < 5e-4, nmse


def test_compile_errors_name_the_file_and_line():
    from pyggml.cuda.runtime import compile_error_message
    log = '/tmp/tmpab12/e7c1.cu(57): error: identifier "acc" is undefined\n1 error detected'
    assert compile_error_message("mmvq.cu", log).startswith("CUDA kernel kernels/mmvq.cu:57 failed to compile")
    log = '/work/kernels/common.cuh(120): error: expected a ";"'
    assert compile_error_message("mmvq.cu", log).startswith("CUDA kernel kernels/common.cuh:120 failed")

"""The CUDA emulator (tests/cuda/emu.h, emulator.py, fake/cupy.py) that lets our kernels and the
CUDA backend run in CI without a GPU: it must compute what a GPU computes, and report the
mistakes a GPU would hide (tests/cuda/emu_selftest.cu has one kernel for each)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.cuda import emulator

pytestmark = pytest.mark.skipif(not emulator.available, reason="no C++ compiler (g++ or clang++) on this machine")


@pytest.fixture(scope="module")
def selftest():
    return emulator.Module(emulator.HERE / "emu_selftest.cu")


@pytest.fixture(scope="module")
def fake_cupy():
    import importlib.util
    spec = importlib.util.spec_from_file_location("fake_cupy", emulator.HERE / "fake" / "cupy.py")
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    return cp


def test_block_sum_with_shared_memory_barriers_and_shuffles(selftest):
    n, block = 1000, 256
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    blocks = (n + block - 1) // block
    out = np.zeros(blocks, np.float32)
    checks = np.zeros(blocks * block, np.int32)
    selftest.get_function("block_sum")((blocks,), (block,), (x, out, checks, np.int32(n)))
    want = np.pad(x, (0, blocks * block - n)).reshape(blocks, block).sum(axis=1)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    assert (checks == 7).all(), np.unique(checks)


def test_a_shuffle_naming_an_exited_lane_is_reported(selftest):
    with pytest.raises(emulator.LaunchError, match="lane 16 has exited before a warp shuffle"):
        selftest.get_function("shuffle_after_exit")((1,), (32,), (np.zeros(32, np.float32),))


def test_lanes_split_between_a_barrier_and_a_shuffle_deadlock(selftest):
    with pytest.raises(emulator.LaunchError, match="deadlock"):
        selftest.get_function("barrier_against_shuffle")((1,), (32,), (np.zeros(32, np.float32),))


def test_a_misaligned_load_is_reported(selftest):
    x = np.zeros(16, np.uint8)
    with pytest.raises(emulator.LaunchError, match="misaligned load"):
        selftest.get_function("misaligned_load")((1,), (1,), (x, np.zeros(1, np.float32)))


def test_launch_arguments_are_checked_against_the_kernel(selftest):
    fn, out = selftest.get_function("takes_i64"), np.zeros(1, np.float32)
    with pytest.raises(TypeError, match="int32 .4 bytes. passed for a 8-byte integer"):
        fn((1,), (1,), (out, np.int32(5)))
    with pytest.raises(TypeError, match="float64 .8 bytes. passed for a 8-byte integer"):
        fn((1,), (1,), (out, 5.0))
    with pytest.raises(TypeError, match="for a pointer parameter"):
        fn((1,), (1,), (np.int64(0), np.int64(5)))
    with pytest.raises(TypeError, match="takes 2 arguments"):
        fn((1,), (1,), (out,))
    fn((1,), (1,), (out, 5))  # a Python int goes as 64 bits, as CuPy passes it
    assert out[0] == 5.0


@pytest.mark.parametrize("grid, block", [((0,), (32,)), ((1,), (2048,)), ((1, 70000), (32,)), ((1,), (1, 1, 128))])
def test_launch_configurations_cuda_refuses(selftest, grid, block):
    with pytest.raises(emulator.LaunchError, match="invalid configuration"):
        selftest.get_function("to_half")(grid, block, (np.zeros(1, np.float32), np.zeros(1, np.uint16), np.int32(1)))


def test_float_to_half_rounds_as_the_gpu_does(selftest):
    """kernels/common.cuh's host float -> f16 (the GPU uses cvt.rn.f16.f32) against numpy: ties
    to even, subnormals, overflow to infinity, NaN."""
    rng = np.random.default_rng(1)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = halves[np.isfinite(halves)]
    ties = (np.sort(finite)[:-1] + np.diff(np.sort(finite)) / 2).astype(np.float32)  # halfway points
    spread = rng.standard_normal(100_000) * 10.0 ** rng.integers(-9, 6, 100_000)
    x = np.concatenate([halves, ties, spread.astype(np.float32),
                        np.float32([65504, 65519.99, 65520, 1e9, -1e9, 2.0 ** -25, 2.0 ** -26, 1e-40, np.inf, -np.inf])])
    y = np.zeros(x.size, np.uint16)
    selftest.get_function("to_half")(((x.size + 255) // 256,), (256,), (x, y, np.int32(x.size)))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(y[~nan], want[~nan].view(np.uint16))
    assert np.isnan(y[nan].view(np.float16)).all()


def test_a_read_past_a_guarded_allocation_is_a_memory_fault(selftest, fake_cupy):
    x, out = fake_cupy.zeros(64, np.float32), fake_cupy.zeros(1, np.float32)
    with pytest.raises(emulator.LaunchError, match="memory fault at address"):
        selftest.get_function("read_past_end")((1,), (1,), (x, out, np.int32(64)))


def test_fake_cupy_keeps_cupys_rules(fake_cupy):
    cp = fake_cupy
    a = cp.zeros((4, 4), np.float32)
    assert isinstance(a + 1, cp.ndarray) and isinstance(cp.exp(a), cp.ndarray)
    with pytest.raises(TypeError, match="Unsupported type"):
        a + np.ones((4, 4), np.float32)  # device and host arrays do not mix
    fn = cp.RawModule(code=(emulator.HERE / "emu_selftest.cu").read_text(),
                      options=(f"-I{emulator.KERNEL_DIR}",)).get_function("to_half")
    with pytest.raises(TypeError, match="host memory passed to a kernel"):
        fn((1,), (32,), (np.zeros(4, np.float32), cp.zeros(4, np.uint16), np.int32(4)))
    _, total = cp.cuda.runtime.memGetInfo()
    with pytest.raises(cp.cuda.memory.OutOfMemoryError):
        cp.cuda.alloc(total + 1)
    with pytest.raises(cp.cuda.compiler.CompileException, match=r"source\.cu\(2\): error"):
        cp.RawModule(code='#include "common.cuh"\nextern "C" __global__ void k() { undefined_name = 1; }',
                     options=(f"-I{emulator.KERNEL_DIR}",)).compile()


def test_cublas_gemm_through_the_fake_reads_what_cublas_reads(fake_cupy, monkeypatch):
    """pyggml/cuda/blas.py (F16 x F16 -> F32 through cublasGemmEx) on strided views: x with
    padded rows, every other row of w, a block of the output's columns.  The fake cuBLAS
    reads device memory by address as cuBLAS does, so wrong leading dimensions or pointers
    give wrong numbers or an error here, as they would on a GPU."""
    cp = fake_cupy
    monkeypatch.setitem(sys.modules, "cupy", cp)
    from pyggml.cuda.blas import gemm_f16_f32
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((5, 80)).astype(np.float16))[:, :64]
    w = cp.asarray(rng.standard_normal((40, 64)).astype(np.float16))[::2]
    out = cp.zeros((5, 50), np.float32)
    gemm_f16_f32(x, w, out[:, 10:30])
    want = x.get().astype(np.float32) @ w.get().astype(np.float32).T
    np.testing.assert_allclose(out.get()[:, 10:30], want, rtol=1e-5, atol=1e-4)
    assert not out.get()[:, :10].any() and not out.get()[:, 30:].any()
    gemm_f16_f32(x, w.T.copy().T, out[:, :20])  # column-major weights: copied dense first
    np.testing.assert_allclose(out.get()[:, :20], want, rtol=1e-5, atol=1e-4)

    blas, rt = cp.cuda.cublas, cp.cuda.runtime
    one = np.ones(1, np.float32)
    handle = cp.cuda.device.get_cublas_handle()
    a, b, c = cp.zeros((4, 8), np.float16), cp.zeros((2, 8), np.float16), cp.zeros((2, 4), np.float32)

    def gemm(k, lda):
        blas.gemmEx(handle, blas.CUBLAS_OP_T, blas.CUBLAS_OP_N, 4, 2, k, one.ctypes.data, a.data.ptr, rt.CUDA_R_16F,
                    lda, b.data.ptr, rt.CUDA_R_16F, 8, one.ctypes.data, c.data.ptr, rt.CUDA_R_32F, 4,
                    blas.CUBLAS_COMPUTE_32F, blas.CUBLAS_GEMM_DEFAULT)
    gemm(8, 8)
    with pytest.raises(blas.CUBLASError, match="leading dimension"):
        gemm(8, 7)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="outside every allocation"):
        gemm(9, 9)  # one more element per row than `a` holds


def test_fake_cupy_captures_only_kernel_launches(fake_cupy):
    """The fake's stream capture, on which the CUDA-graph tests rely: kernel launches on the
    capturing stream are recorded and run at Graph.launch; an allocation or any other device
    operation while capturing is an error, as is capturing the legacy default stream."""
    cp = fake_cupy
    fn = cp.RawModule(code=(emulator.HERE / "emu_selftest.cu").read_text(),
                      options=(f"-I{emulator.KERNEL_DIR}",)).get_function("to_half")
    x, y = cp.asarray(np.arange(4, dtype=np.float32)), cp.zeros(4, np.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        fn((1,), (32,), (x, y, np.int32(4)))
        graph = stream.end_capture()
    assert not y.get().any()  # recorded, not run
    graph.launch()
    np.testing.assert_array_equal(y.get(), np.arange(4, dtype=np.float16).view(np.uint16))
    for forbidden in (lambda: cp.empty(4, np.float32), lambda: x + 1):
        with stream:
            stream.begin_capture()
            with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="captur"):
                forbidden()
            stream.end_capture()
    with cp.cuda.Stream(null=True) as null, pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="legacy"):
        null.begin_capture()

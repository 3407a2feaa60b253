"""Matrix products through cuBLAS with F16 operands and an F32 result.

``cupy.matmul`` of two F16 arrays returns F16: every product of a prompt would be rounded
to F16 and would overflow past 65504 (Gemma's residual stream reaches such values).
llama.cpp's CUDA backend asks cuBLAS for an F32 result with F32 accumulation
(``cublasGemmEx``, ``CUBLAS_COMPUTE_32F``, tensor cores still used); so do we, through
CuPy's low-level binding, handled as ``cupy.cublas.gemm`` handles it (CuPy's handle for
the current device and stream, host pointer mode for alpha and beta, the old mode restored).
"""
from __future__ import annotations

import numpy as np

_ONE = np.ones(1, dtype=np.float32)   # alpha and beta live on the host (CUBLAS_POINTER_MODE_HOST)
_ZERO = np.zeros(1, dtype=np.float32)
INT_MAX = 2**31 - 1                   # cuBLAS takes sizes and leading dimensions as int


def _leading_dim(a) -> int | None:
    """Elements between rows of a 2-D array (cuBLAS's leading dimension), or None when its
    rows are not contiguous, do not step forward, or overlap (then it needs a dense copy)."""
    item, (rows, cols) = a.dtype.itemsize, a.shape
    if cols > 1 and a.strides[1] != item:
        return None
    if rows <= 1:
        return max(cols, 1)
    ld, rest = divmod(a.strides[0], item)
    return ld if rest == 0 and ld >= max(cols, 1) else None


def gemm_f16_f32(x, w, out) -> None:
    """``out[N, M] = x[N, K] @ w[M, K].T``: x and w F16 on the GPU, out F32 (written, not added to).
    Rows may be strided (views of wider buffers); other layouts are copied dense first."""
    import cupy as cp
    cublas = cp.cuda.cublas

    n, k = x.shape
    m = w.shape[0]
    if w.shape[1] != k or out.shape != (n, m):
        raise ValueError(f"gemm: shapes {x.shape} x {w.shape}.T -> {out.shape} do not match")
    if x.dtype != np.float16 or w.dtype != np.float16 or out.dtype != np.float32:
        raise TypeError(f"gemm: wants F16 x F16 -> F32, got {x.dtype} x {w.dtype} -> {out.dtype}")
    if n == 0 or m == 0:
        return
    if k == 0:
        out.fill(0)
        return
    if _leading_dim(x) is None:
        x = cp.ascontiguousarray(x)
    if _leading_dim(w) is None:
        w = cp.ascontiguousarray(w)
    dst = out if _leading_dim(out) is not None else cp.empty((n, m), dtype=cp.float32)
    ldx, ldw, ldo = _leading_dim(x), _leading_dim(w), _leading_dim(dst)
    if max(n, m, k, ldx, ldw, ldo) > INT_MAX:
        raise ValueError(f"gemm: {n}x{m}x{k} (leading dimensions {ldx}, {ldw}, {ldo}) exceeds cuBLAS's int sizes")
    # cuBLAS is column-major: out as stored is the M x N matrix C = op(A) op(B) with
    # A = w read as K x M (so op = T) and B = x read as K x N (op = N).
    handle = cp.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k,
                      _ONE.ctypes.data, w.data.ptr, cp.cuda.runtime.CUDA_R_16F, ldw,
                      x.data.ptr, cp.cuda.runtime.CUDA_R_16F, ldx,
                      _ZERO.ctypes.data, dst.data.ptr, cp.cuda.runtime.CUDA_R_32F, ldo,
                      cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    if dst is not out:
        out[...] = dst

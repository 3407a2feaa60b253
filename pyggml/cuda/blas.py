"""Matrix products through cuBLAS with F16 operands and an F32 result.

``cupy.matmul`` of two F16 arrays returns F16: every product of a prompt would be rounded
to F16 and would overflow past 65504 (Gemma's residual stream reaches such values).
llama.cpp's CUDA backend asks cuBLAS for an F32 result with F32 accumulation
(``cublasGemmEx``, ``CUBLAS_COMPUTE_32F``, tensor cores still used); so do we, through
CuPy's low-level binding, handled as ``cupy.cublas.gemm`` handles it (CuPy's handle for
the current device and stream, the pointer mode set for alpha and beta, the old one restored).

The F32 activations must become F16 operands, and past 65504 they would be inf: activations
whose largest magnitude passes ``F16_SAFE`` are scaled by a power of two first (exact), and
cuBLAS's alpha scales the product back - both computed on the GPU, so nothing waits for it.
"""
from __future__ import annotations

import numpy as np

INT_MAX = 2**31 - 1  # cuBLAS takes sizes and leading dimensions as int
F16_SAFE = 32768.0   # activations are scaled below this before they become F16 (max 65504)
_ZEROS: dict[int, object] = {}  # per device: beta = 0 on the GPU (CUBLAS_POINTER_MODE_DEVICE)


def to_f16_scaled(x):
    """x (F32, on the GPU) as F16 x * 2**-k, and 2**k as a one-element F32 device array: k is the
    least k >= 0 with max|x| * 2**-k <= F16_SAFE (0 for ordinary activations)."""
    import cupy as cp
    amax = cp.abs(x).max()
    # (amax == 0: log2 gives -inf, and the scale stays 1)
    up = cp.exp2(cp.maximum(cp.ceil(cp.log2(amax / np.float32(F16_SAFE))), np.float32(0))).astype(cp.float32)
    return (x / up).astype(cp.float16), up.reshape(1)


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


def gemm_f16_f32(x, w, out, alpha=None) -> None:
    """``out[N, M] = alpha * x[N, K] @ w[M, K].T``: x and w F16 on the GPU, out F32 (written, not
    added to); alpha a one-element F32 device array (to_f16_scaled's), or 1.  Rows may be
    strided (views of wider buffers); other layouts are copied dense first."""
    import cupy as cp
    cublas = cp.cuda.cublas

    n, k = x.shape
    m = w.shape[0]
    if w.shape[1] != k or out.shape != (n, m):
        raise ValueError(f"gemm: shapes {x.shape} x {w.shape}.T -> {out.shape} do not match")
    if x.dtype != np.float16 or w.dtype != np.float16 or out.dtype != np.float32 or \
            (alpha is not None and (alpha.dtype != np.float32 or alpha.size != 1)):
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
    device = cp.cuda.Device().id
    if device not in _ZEROS:
        _ZEROS[device] = cp.zeros(1, dtype=cp.float32)
    alpha = alpha if alpha is not None else cp.ones(1, dtype=cp.float32)
    handle = cp.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_DEVICE)  # alpha and beta are on the GPU
    try:
        cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k,
                      alpha.data.ptr, w.data.ptr, cp.cuda.runtime.CUDA_R_16F, ldw,
                      x.data.ptr, cp.cuda.runtime.CUDA_R_16F, ldx,
                      _ZEROS[device].data.ptr, dst.data.ptr, cp.cuda.runtime.CUDA_R_32F, ldo,
                      cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    if dst is not out:
        out[...] = dst

"""The activation side of ggml's CPU matrix products, reproduced exactly.

ggml never multiplies quantized weights with float activations: it first converts each
activation row to the weight type's ``vec_dot_type`` (Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL, Q8_1
for Q4_1/Q5_1, Q8_K for the K-quants and IQ4_XS, F16 for F16 weights) and computes integer
block dot products (qdot.py).  ``quantize_q8`` produces those 8-bit blocks: the integers (as
float32, exact), the scale per block, and the per-block sum the dot products use.

Details that matter (checked against llama.cpp's intermediate tensors):
- Q8_0/Q8_1 as x86's SIMD code does it: ``q = rint(x * 127/amax)``, ``d`` stored as F16.
- Q8_1 also stores ``s = F16(d * sum(q))`` (d before its rounding to F16); the Q4_1/Q5_1 dot
  uses it for the block minimum.
- Q8_K: ``iscale = -127/max`` (max = the signed value of largest magnitude),
  ``q = min(127, rint(iscale x))``, ``d = 1/iscale`` in float32, and ``bsums``, the sum of
  q per 16 values, which the K-quant dots use for the mins (Q4_K/Q5_K) and the offset (Q6_K).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import carray, njit

from .kinds import Act
from .parts import LAYERS, part, sample_x
from .rows import RowCall, address_of, c_rows, row_args, row_kernel, rows_call, run_calls, serial_call
from .simd import KERNEL, pointer, round_f16


@njit(inline="always", **KERNEL)
def _quantize_row(x, r, kind, yq, yd, ys):
    """Row r of quantize_q8."""
    k = x.shape[1]
    block = 256 if kind == Act.Q8_K else 32
    for b in range(k // block):
        lo = b * block
        if kind == Act.Q8_K:
            amax, vmax = np.float32(0.0), np.float32(0.0)
            for i in range(lo, lo + block):
                if abs(x[r, i]) > amax:
                    amax, vmax = abs(x[r, i]), x[r, i]
            if amax == 0.0:
                yq[r, lo:lo + block] = 0.0
                yd[r, b] = 0.0
                ys[r, b * 16:b * 16 + 16] = 0.0
                continue
            iscale = np.float32(-127.0) / vmax
            yd[r, b] = np.float32(1.0) / iscale
            for i in range(lo, lo + block):
                yq[r, i] = min(np.float32(127.0), np.rint(iscale * x[r, i]))
            for s in range(16):
                acc = np.float32(0.0)
                for i in range(lo + 16 * s, lo + 16 * s + 16):
                    acc += yq[r, i]
                ys[r, b * 16 + s] = acc
            continue
        amax = np.float32(0.0)
        for i in range(lo, lo + block):
            amax = max(amax, abs(x[r, i]))
        d = amax / np.float32(127.0)
        ident = np.float32(127.0) / amax if amax != 0.0 else np.float32(0.0)
        qsum = np.float32(0.0)
        for i in range(lo, lo + block):
            q = np.rint(x[r, i] * ident)
            qsum += q
            yq[r, i] = q
        yd[r, b] = round_f16(d)
        ys[r, b] = round_f16(d * qsum) if kind == Act.Q8_1 else qsum


def _quantize_rows(start, end, x_at, k, kind, yq_at, yd_at, ys_at, i6, i7, i8, i9, f0, f1):
    """Rows start..end of quantize_q8 (a row kernel: rows.py)."""
    blocks, sums = (k // 256, k // 16) if kind == Act.Q8_K else (k // 32, k // 32)
    x = carray(pointer(x_at, np.float32), (end, k))
    yq = carray(pointer(yq_at, np.float32), (end, k))
    yd = carray(pointer(yd_at, np.float32), (end, blocks))
    ys = carray(pointer(ys_at, np.float32), (end, sums))
    for r in range(start, end):
        _quantize_row(x, r, kind, yq, yd, ys)


QuantizeArgs = row_args(_quantize_rows)


def quantize_q8(x: np.ndarray, kind: int, yq: np.ndarray, yd: np.ndarray, ys: np.ndarray) -> None:
    """x [N, K] float32 -> yq [N, K] the 8-bit integers (as float32), yd [N, blocks] their
    scale, ys: Q8_1 F16(d * sum q) per block [N, K/32]; Q8_K ``bsums``, sum q per 16 values
    [N, K/16] (each C-contiguous, as activation_arrays makes them)."""
    run_calls([quantize_call(x, kind, yq, yd, ys, threads=True)])


def quantize_q8_serial(x: np.ndarray, kind: int, yq: np.ndarray, yd: np.ndarray, ys: np.ndarray) -> None:
    """quantize_q8 in this thread: for a row or two, less than waking the others."""
    run_calls([quantize_call(x, kind, yq, yd, ys)])


SERIAL_ROWS = 2  # activations of up to this many rows are quantized in the calling thread


@functools.cache
def quantize_rows_at() -> int:
    """The address of quantize_q8's row kernel (rows.ROW_KERNEL: start, end, x, k, kind, yq, yd,
    ys - C-contiguous float32 arrays of activation_arrays' shapes)."""
    return row_kernel(_quantize_rows)


def activation_shapes(n: int, k: int, kind: int) -> tuple[tuple[int, int], ...]:
    """The shapes of the arrays ``quantize_q8`` fills for n rows of k values."""
    return (n, k), (n, k // 256 if kind == Act.Q8_K else k // 32), (n, k // 16 if kind == Act.Q8_K else k // 32)


def activation_arrays(n: int, k: int, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arrays ``quantize_q8`` fills for n rows of k values (uninitialized)."""
    return tuple(np.empty(shape, dtype=np.float32) for shape in activation_shapes(n, k, kind))


def quantize_call(x: np.ndarray, kind: int, yq: np.ndarray, yd: np.ndarray, ys: np.ndarray,
                  threads: bool = False) -> RowCall:
    """quantize_q8 as a call (rows.RowCall): x's rows in the calling thread, or on the threads."""
    if not (x.ndim == 2 and c_rows(np.float32, x, yq, yd, ys)
            and (yq.shape, yd.shape, ys.shape) == activation_shapes(*x.shape, kind)):
        raise ValueError("quantize_q8: x, yq, yd and ys must be C-contiguous float32, of activation_arrays' shapes")
    return (rows_call if threads else serial_call)(
        quantize_rows_at(), x.shape[0], QuantizeArgs(x_at=address_of(x), k=x.shape[1], kind=int(kind), yq_at=address_of(yq),
                                                     yd_at=address_of(yd), ys_at=address_of(ys)))


def quantize(x: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_q8`` with its outputs allocated: (integers, scales, sums)."""
    yq, yd, ys = activation_arrays(*x.shape, kind)
    (quantize_q8 if x.shape[0] > SERIAL_ROWS else quantize_q8_serial)(x, kind, yq, yd, ys)
    return yq, yd, ys


def activation_values(x: np.ndarray, kind: int) -> np.ndarray:
    """The float values ggml's vec_dot_type holds for x (for decode-then-dot products)."""
    if kind == Act.F32:
        return x
    if kind == Act.F16:
        return x.astype(np.float16).astype(np.float32)
    yq, yd, _ = quantize(x, kind)
    block = 256 if kind == Act.Q8_K else 32
    return (yq.reshape(len(x), -1, block) * yd[:, :, None]).reshape(x.shape)


@part("activations", 0.9, LAYERS)
def _compile_activations() -> None:
    """The quantizer's rows (a call made, not run: rows.run_table, which runs every call, is the
    table part - a part that ran a call would compile it again in its own process)."""
    x = sample_x(2)
    quantize_call(x, int(Act.Q8_0), *activation_arrays(2, x.shape[1], int(Act.Q8_0)))

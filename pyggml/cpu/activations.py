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

from ..types import ACTIVATION_BLOCKS, Type
from .kinds import Act
from .parts import LAYERS, part, sample_x
from .rows import RowCall, address_of, c_rows, row_args, row_kernel, rows_call, run_calls, serial_call
from .simd import KERNEL, f16_bits, half_to_float, pointer, round_f16


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


# -- the activations as blocks: what a tensor split sends between devices ---------------------
# ggml's CPU quantizes each activation row block by block (from_float) before a product, so a
# device's rows of an activation, quantized alone, are the bytes of those rows of the whole.
# models/tensor_split.py sends those (ops.cast), and the product takes them as they are
# (ops.mul_mat's second operand in its vec_dot type).  Their bytes, as ggml's block structs:
#   Q8_0 (34 bytes per 32):  d F16, q int8[32]
#   Q8_1 (36 bytes per 32):  d F16, s F16 (= d * sum q), q int8[32]
#   Q8_K (292 bytes per 256): d F32, q int8[256], bsums int16[16] (sums of q per 16)
# Every field lies on its own width's boundary (a block's size is a multiple of it), so a
# kernel views a row's bytes as uint16 / float32 / int16 arrays as well.
BLOCK_BYTES = {Act.Q8_0: 34, Act.Q8_1: 36, Act.Q8_K: 292}


def block_kind(t: Type) -> Act | None:
    """The kind of activations blocks of type ``t`` hold (types.ACTIVATION_BLOCKS), else None."""
    return Act[t.name] if t in ACTIVATION_BLOCKS else None


def _pack_rows(start, end, x_at, k, out_at, kind, i4, i5, i6, i7, i8, i9, f0, f1):
    """Rows start..end of F32 x [rows, k] as blocks of ``kind`` (uint8 [rows, row bytes]): the
    integers, scales and sums quantize_q8 gives a product, as ggml stores them."""
    block = 256 if kind == Act.Q8_K else 32
    size = 292 if kind == Act.Q8_K else 36 if kind == Act.Q8_1 else 34
    blocks = k // block
    x = carray(pointer(x_at, np.float32), (end, k))
    out = carray(pointer(out_at, np.uint8), (end, blocks * size))
    halves = carray(pointer(out_at, np.uint16), (end, blocks * size // 2))
    shorts = carray(pointer(out_at, np.int16), (end, blocks * size // 2))
    floats = carray(pointer(out_at, np.float32), (end, blocks * size // 4))
    yq = np.empty((1, k), dtype=np.float32)
    yd = np.empty((1, blocks), dtype=np.float32)
    ys = np.empty((1, k // 16 if kind == Act.Q8_K else blocks), dtype=np.float32)
    for r in range(start, end):
        _quantize_row(x[r:r + 1], 0, kind, yq, yd, ys)
        for b in range(blocks):
            at = b * size
            if kind == Act.Q8_K:
                floats[r, at // 4] = yd[0, b]
                for j in range(16):
                    shorts[r, (at + 4 + 256) // 2 + j] = np.int16(ys[0, b * 16 + j])
                first = at + 4
            else:
                halves[r, at // 2] = f16_bits(yd[0, b])
                if kind == Act.Q8_1:
                    halves[r, at // 2 + 1] = f16_bits(ys[0, b])
                first = at + (4 if kind == Act.Q8_1 else 2)
            for i in range(block):
                out[r, first + i] = np.uint8(np.int32(yq[0, b * block + i]) & 0xFF)


def _unpack_rows(start, end, q_at, k, yq_at, yd_at, ys_at, kind, i6, i7, i8, i9, f0, f1):
    """Rows start..end of blocks of ``kind`` (uint8 [rows, row bytes]) as quantize_q8's arrays:
    what it gives for the values the blocks were made from."""
    block = 256 if kind == Act.Q8_K else 32
    size = 292 if kind == Act.Q8_K else 36 if kind == Act.Q8_1 else 34
    blocks = k // block
    q = carray(pointer(q_at, np.int8), (end, blocks * size))
    halves = carray(pointer(q_at, np.uint16), (end, blocks * size // 2))
    shorts = carray(pointer(q_at, np.int16), (end, blocks * size // 2))
    floats = carray(pointer(q_at, np.float32), (end, blocks * size // 4))
    yq = carray(pointer(yq_at, np.float32), (end, k))
    yd = carray(pointer(yd_at, np.float32), (end, blocks))
    ys = carray(pointer(ys_at, np.float32), (end, k // 16 if kind == Act.Q8_K else blocks))
    for r in range(start, end):
        for b in range(blocks):
            at = b * size
            if kind == Act.Q8_K:
                yd[r, b] = floats[r, at // 4]
                for j in range(16):
                    ys[r, b * 16 + j] = np.float32(shorts[r, (at + 4 + 256) // 2 + j])
                first = at + 4
            else:
                yd[r, b] = half_to_float(halves[r, at // 2])
                first = at + (4 if kind == Act.Q8_1 else 2)
            qsum = np.float32(0.0)
            for i in range(block):
                v = np.float32(q[r, first + i])
                qsum += v
                yq[r, b * block + i] = v
            if kind == Act.Q8_1:
                ys[r, b] = half_to_float(halves[r, at // 2 + 1])
            elif kind == Act.Q8_0:
                ys[r, b] = qsum


PackArgs = row_args(_pack_rows)
UnpackArgs = row_args(_unpack_rows)


@functools.cache
def pack_rows_at() -> int:
    return row_kernel(_pack_rows)


@functools.cache
def unpack_rows_at() -> int:
    return row_kernel(_unpack_rows)


def block_row_bytes(k: int, kind: int) -> int:
    return k // (256 if kind == Act.Q8_K else 32) * BLOCK_BYTES[Act(kind)]


def pack_call(x: np.ndarray, kind: int, out: np.ndarray, threads: bool = False) -> RowCall:
    """F32 rows x [N, K] into blocks of ``kind`` (Q8_0, Q8_1 or Q8_K) ``out`` (uint8 [N, row
    bytes]), as a call."""
    if not (x.ndim == 2 and c_rows(np.float32, x) and c_rows(np.uint8, out) and kind in BLOCK_BYTES
            and x.shape[1] % (256 if kind == Act.Q8_K else 32) == 0 and out.shape == (x.shape[0], block_row_bytes(x.shape[1], kind))):
        raise ValueError("pack: x must be C-contiguous float32 rows of whole blocks, out their uint8 blocks")
    return (rows_call if threads else serial_call)(
        pack_rows_at(), x.shape[0], PackArgs(x_at=address_of(x), k=x.shape[1], out_at=address_of(out), kind=int(kind)))


def unpack_call(q: np.ndarray, kind: int, yq: np.ndarray, yd: np.ndarray, ys: np.ndarray, threads: bool = False) -> RowCall:
    """Blocks of ``kind`` q (uint8 [N, row bytes]) into quantize_q8's arrays, as a call."""
    n, k = yq.shape
    if not (kind in BLOCK_BYTES and c_rows(np.uint8, q) and c_rows(np.float32, yq, yd, ys)
            and q.shape == (n, block_row_bytes(k, kind)) and (yq.shape, yd.shape, ys.shape) == activation_shapes(n, k, kind)):
        raise ValueError("unpack: q must be C-contiguous blocks, yq, yd and ys of activation_arrays' shapes")
    return (rows_call if threads else serial_call)(
        unpack_rows_at(), n, UnpackArgs(q_at=address_of(q), k=k, yq_at=address_of(yq), yd_at=address_of(yd),
                                        ys_at=address_of(ys), kind=int(kind)))


def pack(x: np.ndarray, kind: int) -> np.ndarray:
    """F32 rows [N, K] as blocks of ``kind`` (uint8 [N, row bytes]), as a product would quantize them."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], block_row_bytes(x.shape[1], kind)), dtype=np.uint8)
    run_calls([pack_call(x, kind, out, threads=x.shape[0] > SERIAL_ROWS)])
    return out


def unpack(q: np.ndarray, k: int, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of ``kind`` (uint8 [N, row bytes]) as quantize_q8's (integers, scales, sums)."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    yq, yd, ys = activation_arrays(q.shape[0], k, kind)
    run_calls([unpack_call(q, kind, yq, yd, ys, threads=q.shape[0] > SERIAL_ROWS)])
    return yq, yd, ys


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

"""Row decoders for the quantized weight formats, compiled with numba.

Each ``dec_<type>(row, out, f16)`` turns the bytes of one row into float32 values with
exactly the float operations of :mod:`pyggml.quants` (so results are bit-identical), but
one row at a time into a small scratch vector: the matrix kernels decode a weight row in
cache and use it at once, never materializing the whole matrix.  ``f16`` is the 65536-entry
half -> float table (ggml's ``ggml_table_f32_f16``).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import carray, njit, prange
from numba.extending import overload

from ..quants.layouts import KVALUES_MXFP4
from ..types import Type
from .kinds import DECODER, Dec, kernel_of_kind, literal_kind
from .parts import K, kind_part, part, sample_weights, sample_x
from .rows import RowCall, address_of, c_rows, row_args, row_kernel, rows_call, run_calls
from .simd import KERNEL, pointer

F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
KV_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
KV_MXFP4 = KVALUES_MXFP4.astype(np.float32)

_jit = njit(fastmath=False, inline="always", **KERNEL)


@_jit
def e8m0_half(e):
    """ggml_e8m0_to_fp32_half (MXFP4's block scale): 2**(e - 128) as float32 (e < 2: subnormal bits)."""
    e = np.uint32(e)
    bits = np.uint32(np.uint32(0x00200000) << e) if e < np.uint32(2) else np.uint32((e - np.uint32(1)) << np.uint32(23))
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


@_jit
def u8_at(row, i):
    return np.int64(row[i])


@_jit
def f16_at(row, p, f16):
    return f16[u8_at(row, p) | (u8_at(row, p + 1) << 8)]


@_jit
def opaque_zero(f16):
    """A zero the compiler cannot see through (the table has 2**16 entries).

    OR-ing ``(zero >> j) & 1`` into a value changes nothing, but it makes LLVM vectorize
    the 16-lane nibble loops instead of unrolling them into scalar code (bench/matmul.py
    shows what it is worth).
    """
    return np.int64(f16.size) >> 40


@_jit
def dec_q4_0(row, out, f16):
    z = opaque_zero(f16)
    for b in range(out.size // 32):
        p, o = b * 18, b * 32
        d = f16_at(row, p, f16)
        for j in range(16):
            q = u8_at(row, p + 2 + j)
            out[o + j] = d * np.float32(((q & 15) | ((z >> j) & 1)) - 8)
            out[o + 16 + j] = d * np.float32(((q >> 4) | ((z >> (j + 16)) & 1)) - 8)


@_jit
def dec_q4_1(row, out, f16):
    z = opaque_zero(f16)
    for b in range(out.size // 32):
        p, o = b * 20, b * 32
        d, m = f16_at(row, p, f16), f16_at(row, p + 2, f16)
        for j in range(16):
            q = u8_at(row, p + 4 + j)
            out[o + j] = d * np.float32((q & 15) | ((z >> j) & 1)) + m
            out[o + 16 + j] = d * np.float32((q >> 4) | ((z >> (j + 16)) & 1)) + m


@_jit
def u32_at(row, p):
    return u8_at(row, p) | (u8_at(row, p + 1) << 8) | (u8_at(row, p + 2) << 16) | (u8_at(row, p + 3) << 24)


@_jit
def dec_q5_0(row, out, f16):
    for b in range(out.size // 32):
        p, o = b * 22, b * 32
        d = f16_at(row, p, f16)
        qh = u32_at(row, p + 2)
        for j in range(16):
            q = u8_at(row, p + 6 + j)
            out[o + j] = d * np.float32(((q & 15) | (((qh >> j) & 1) << 4)) - 16)
            out[o + 16 + j] = d * np.float32(((q >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16)


@_jit
def dec_q5_1(row, out, f16):
    for b in range(out.size // 32):
        p, o = b * 24, b * 32
        d, m = f16_at(row, p, f16), f16_at(row, p + 2, f16)
        qh = u32_at(row, p + 4)
        for j in range(16):
            q = u8_at(row, p + 8 + j)
            out[o + j] = d * np.float32((q & 15) | (((qh >> j) & 1) << 4)) + m
            out[o + 16 + j] = d * np.float32((q >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m


@_jit
def _dec_q8(row, out, f16, size, skip):
    z = opaque_zero(f16)
    for b in range(out.size // 32):
        p, o = b * size, b * 32
        d = f16_at(row, p, f16)
        for j in range(32):
            out[o + j] = np.float32(np.int8(u8_at(row, p + skip + j) | ((z >> j) & 1))) * d


@_jit
def dec_q8_0(row, out, f16):
    _dec_q8(row, out, f16, 34, 2)


@_jit
def dec_q8_1(row, out, f16):
    _dec_q8(row, out, f16, 36, 4)


@_jit
def dec_iq4_nl(row, out, f16):
    for b in range(out.size // 32):
        p, o = b * 18, b * 32
        d = f16_at(row, p, f16)
        for j in range(16):
            q = u8_at(row, p + 2 + j)
            out[o + j] = d * KV_IQ4NL[q & 15]
            out[o + 16 + j] = d * KV_IQ4NL[q >> 4]


@_jit
def dec_mxfp4(row, out, f16):
    for b in range(out.size // 32):
        p, o = b * 17, b * 32
        d = e8m0_half(row[p])
        for j in range(16):
            q = u8_at(row, p + 1 + j)
            out[o + j] = KV_MXFP4[q & 15] * d
            out[o + 16 + j] = KV_MXFP4[q >> 4] * d


@_jit
def dec_q2_k(row, out, f16):
    for b in range(out.size // 256):
        p, o = b * 84, b * 256
        d, dmin = f16_at(row, p + 80, f16), f16_at(row, p + 82, f16)
        for g in range(16):  # 16 groups of 16: scale byte g, plane (g // 2) % 4 of half g // 8
            sc = u8_at(row, p + g)
            dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
            qs, shift = p + 16 + (g // 8) * 32 + (g % 2) * 16, 2 * ((g // 2) % 4)
            for j in range(16):
                out[o + g * 16 + j] = dl * np.float32((u8_at(row, qs + j) >> shift) & 3) - ml


@_jit
def _q3k_scale(row, p, i):
    low = (u8_at(row, p + i) & 15) if i < 8 else (u8_at(row, p + i - 8) >> 4)
    high = (u8_at(row, p + 8 + i % 4) >> (2 * (i // 4))) & 3
    return np.int64(low | (high << 4)) - 32


@_jit
def dec_q3_k(row, out, f16):
    for b in range(out.size // 256):
        p, o = b * 110, b * 256
        d = f16_at(row, p + 108, f16)
        for g in range(16):
            dl = d * np.float32(_q3k_scale(row, p + 96, g))
            half, plane = g // 8, (g // 2) % 4
            qs, hm, l0 = p + 32 + half * 32, p, (g % 2) * 16
            shift, hshift = 2 * plane, half * 4 + plane
            for j in range(16):
                low = (u8_at(row, qs + l0 + j) >> shift) & 3
                hbit = (u8_at(row, hm + l0 + j) >> hshift) & 1
                out[o + g * 16 + j] = dl * np.float32(low - ((hbit ^ 1) << 2))


@_jit
def _k4_scale_min(row, p, j):
    if j < 4:
        return u8_at(row, p + j) & 63, u8_at(row, p + j + 4) & 63
    return (u8_at(row, p + j + 4) & 15) | ((u8_at(row, p + j - 4) >> 6) << 4), (u8_at(row, p + j + 4) >> 4) | ((u8_at(row, p + j) >> 6) << 4)


@_jit
def _dec_k_nibbles(row, out, f16, block_bytes, qs_at, five):
    """Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and minima; 4-bit values at qs_at,
    and for Q5_K (``five``) a fifth bit per value from the 32 bytes at 16."""
    z = opaque_zero(f16)
    for b in range(out.size // 256):
        p, o = b * block_bytes, b * 256
        d, dmin = f16_at(row, p, f16), f16_at(row, p + 2, f16)
        for s in range(8):
            sc, mn = _k4_scale_min(row, p + 4, s)
            ds, dm = d * np.float32(sc), dmin * np.float32(mn)
            shift = 4 * (s & 1)
            for l in range(32):
                high = (((u8_at(row, p + 16 + l) >> s) & 1) << 4) if five else ((z >> l) & 1)
                q = ((u8_at(row, p + qs_at + (s // 2) * 32 + l) >> shift) & 15) | high
                out[o + s * 32 + l] = ds * np.float32(q) - dm


@_jit
def dec_q4_k(row, out, f16):
    _dec_k_nibbles(row, out, f16, 144, 16, False)


@_jit
def dec_q5_k(row, out, f16):
    _dec_k_nibbles(row, out, f16, 176, 48, True)


@_jit
def dec_q6_k(row, out, f16):
    for b in range(out.size // 256):
        p, o = b * 210, b * 256
        d = f16_at(row, p + 208, f16)
        for half in range(2):
            ql, qh, sc, oo = p + half * 64, p + 128 + half * 32, p + 192 + half * 8, o + half * 128
            for plane in range(4):
                lo_off, lo_shift = (plane % 2) * 32, 4 * (plane // 2)
                for g in range(2):
                    ds = d * np.float32(np.int8(u8_at(row, sc + plane * 2 + g)))
                    for j in range(16):
                        l = g * 16 + j
                        q = ((u8_at(row, ql + lo_off + l) >> lo_shift) & 15) | (((u8_at(row, qh + l) >> (2 * plane)) & 3) << 4)
                        out[oo + plane * 32 + l] = ds * np.float32(q - 32)


@_jit
def dec_q8_k(row, out, f16):
    for b in range(out.size // 256):
        p, o = b * 292, b * 256
        d = _f32(row, p)
        for j in range(256):
            out[o + j] = np.float32(np.int8(u8_at(row, p + 4 + j))) * d


@_jit
def _f32(row, p):
    """Little-endian IEEE float32 from 4 bytes (numba cannot reinterpret a scalar)."""
    bits = u32_at(row, p)
    exp, man = (bits >> 23) & 255, bits & 0x7FFFFF
    if exp == 255:
        val = np.inf if man == 0 else np.nan
    elif exp == 0:
        val = math.ldexp(float(man), -149)
    else:
        val = math.ldexp(float(man | 0x800000), exp - 150)
    return np.float32(-val if bits >> 31 else val)


@_jit
def dec_iq4_xs(row, out, f16):
    for b in range(out.size // 256):
        p, o = b * 136, b * 256
        d = f16_at(row, p, f16)
        sh = u8_at(row, p + 2) | (u8_at(row, p + 3) << 8)
        for s in range(8):
            lo = (u8_at(row, p + 4 + s // 2) >> (4 * (s % 2))) & 15
            ls = np.int64(lo | (((sh >> (2 * s)) & 3) << 4)) - 32
            dl = d * np.float32(ls)
            for j in range(16):
                q = u8_at(row, p + 8 + s * 16 + j)
                out[o + s * 32 + j] = dl * KV_IQ4NL[q & 15]
                out[o + s * 32 + 16 + j] = dl * KV_IQ4NL[q >> 4]


@_jit
def dec_f16(row, out, f16):
    z = opaque_zero(f16)
    for i in range(out.size):
        out[i] = f16[u8_at(row, 2 * i) | (u8_at(row, 2 * i + 1) << 8) | ((z >> (i & 31)) & 1)]


DECODERS = {
    Type.Q4_0: dec_q4_0, Type.Q4_1: dec_q4_1, Type.Q5_0: dec_q5_0, Type.Q5_1: dec_q5_1,
    Type.Q8_0: dec_q8_0, Type.Q8_1: dec_q8_1, Type.IQ4_NL: dec_iq4_nl,
    Type.Q2_K: dec_q2_k, Type.Q3_K: dec_q3_k, Type.Q4_K: dec_q4_k, Type.Q5_K: dec_q5_k,
    Type.Q6_K: dec_q6_k, Type.F16: dec_f16, Type.Q8_K: dec_q8_k, Type.IQ4_XS: dec_iq4_xs, Type.MXFP4: dec_mxfp4,
}


# -- kernels over rows ----------------------------------------------------------------------------
# They take the decoder as an integer (a kinds.Dec) rather than as a function, which numba
# cannot cache, and the number is a constant of each kernel (a closure's), so that a kernel
# compiles one decoder, not all fifteen: a model compiles the decoders of its types.  (Stale
# machine code after an edit to a decoder is kernel_cache.py's concern: the cache folder is
# keyed by every kernel source.)

assert set(DECODER) == set(DECODERS), "every decoder has its number in kinds.Dec"
_BY_DEC = {DECODER[t]: fn for t, fn in DECODERS.items()}


def decode_row(kind: int, row, out, f16) -> None:
    """The decoder of ``kind`` (a :class:`kinds.Dec`) applied to one row; in a kernel, kind is a
    constant of the kernel (numba types it as a literal) and only its decoder is compiled."""
    _BY_DEC[Dec(kind)](row, out, f16)


@overload(decode_row, prefer_literal=True)  # not inlined: its float steps must not take fastmath's
def _decode_row(kind, row, out, f16):
    dec = _BY_DEC[Dec(literal_kind(kind, "decode_row"))]
    return lambda kind, row, out, f16: dec(row, out, f16)


def fused_matmul(kind: int, w, x, out, f16) -> None:
    """out[n, m] = dot(decode(w[m]), x[n]) for all m, n: each weight row is decoded into a
    small scratch vector and used at once for every column."""
    _decoder_kernels(int(kind))[0](w, x, out, f16)


def decode_rows_call(kind: int, w: np.ndarray, out: np.ndarray, f16: np.ndarray,
                     ids: np.ndarray | None = None) -> RowCall:
    """decode_rows as a call (rows.RowCall); with ``ids`` (int64, a row id per row of out, in
    [0, rows of w) when the call runs: the caller checks them), the rows of w they name."""
    if not (w.ndim == 2 and out.ndim == 2 and c_rows(np.uint8, w) and c_rows(np.float32, out, f16)
            and (w.shape[0] == out.shape[0] if ids is None else c_rows(np.int64, ids) and ids.shape == out.shape[:1])
            and f16.size == 65536):
        raise ValueError("decode_rows: w and out must be C-contiguous, a row of out for each row of w (or id)")
    _, at, args = _decoder_kernels(int(kind))
    return rows_call(at, out.shape[0], args(w_at=address_of(w), row_bytes=w.shape[1], out_at=address_of(out),
                                            k=out.shape[1], f16_at=address_of(f16),
                                            ids_at=0 if ids is None else address_of(ids), n_w_rows=w.shape[0]))


def decode_rows(kind: int, w: np.ndarray, out: np.ndarray, f16: np.ndarray) -> None:
    """Every row of w (uint8 [M, row_bytes], C-contiguous) decoded into the same row of out
    (float32 [M, K], C-contiguous)."""
    run_calls([decode_rows_call(kind, w, out, f16)])


@functools.cache
def _decoder_kernels(kind: int):
    """fused_matmul's kernel, and the address of decode_rows' (rows.py) with its argument record,
    for one decoder (``kind`` a constant of both)."""
    def fused(w, x, out, f16):
        m_rows, k = w.shape[0], x.shape[1]
        n_chunks = min(m_rows, 64)
        per = (m_rows + n_chunks - 1) // n_chunks
        for c in prange(n_chunks):
            _fused_chunk(kind, w, x, out, f16, c * per, min(m_rows, (c + 1) * per))

    def rows(start, end, w_at, row_bytes, out_at, k, f16_at, ids_at, n_w_rows, i7, i8, i9, f0, f1):
        """Rows start..end of out, each the decoded row of w at the same index, or at ids[row]
        (ids_at not 0: GET_ROWS's, checked by the caller) of n_w_rows."""
        w = carray(pointer(w_at, np.uint8), (n_w_rows if ids_at != 0 else end, row_bytes))
        out = carray(pointer(out_at, np.float32), (end, k))
        f16 = carray(pointer(f16_at, np.float32), (65536,))
        for m in range(start, end):
            src = carray(pointer(ids_at, np.int64), (end,))[m] if ids_at != 0 else m
            decode_row(kind, w[src], out[m], f16)
    name = Dec(kind).name
    return kernel_of_kind(fused, name, parallel=True, fastmath=True, **KERNEL), row_kernel(rows, name), row_args(rows)


@njit(fastmath=True, **KERNEL)
def _fused_chunk(kind, w, x, out, f16, start, end):
    """fused_matmul's rows start..end (a function of its own: quicker to compile than the
    parallel loop's body)."""
    k, n_cols = x.shape[1], x.shape[0]
    row = np.empty(k, dtype=np.float32)
    for m in range(start, end):
        decode_row(kind, w[m], row, f16)
        for n in range(n_cols):
            xn = x[n]
            acc = np.float32(0.0)
            for i in range(k):
                acc += row[i] * xn[i]
            out[n, m] = acc


@njit(parallel=True, **KERNEL)
def f16_values(bits, f16, out):
    """float32 values of float16 bits ([a, b, c, d], any strides) through the 65536-entry
    table: faster than numpy's conversion, and exact (the KV cache is read every step)."""
    n0, n1, n2, n3 = bits.shape
    for i in prange(n0 * n1):
        a, b = i // n1, i % n1
        for c in range(n2):
            for d in range(n3):
                out[a, b, c, d] = f16[bits[a, b, c, d]]


# -- what warmup.py compiles of these kernels (pyggml/cpu/parts.py) -----------------------------
@part("f16", 0.4)
def _compile_f16() -> None:  # F16 tensors read as floats (ops.base.reader): not the KV cache, which attention reads itself
    f16_values(np.zeros((1, 1, 1, 4), dtype=np.uint16), F16_TABLE, np.empty((1, 1, 1, 4), dtype=np.float32))


@kind_part("decoder", Dec, lambda d: 0.5)
def _compile_decoder(dec: Dec) -> None:  # the row lookups of an embedding, and decoded products
    decode_rows_call(dec, sample_weights(Type[dec.name], 2), np.empty((2, K), dtype=np.float32), F16_TABLE)  # (made, not run)


@kind_part("fused", Dec, lambda d: 1.2)
def _compile_fused(dec: Dec) -> None:  # few columns decoded and dotted
    fused_matmul(dec, sample_weights(Type[dec.name], 2), sample_x(2), np.empty((2, 2), dtype=np.float32), F16_TABLE)

"""The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, IQ4_NL and MXFP4.

Every function takes/returns whole blocks: ``(n_blocks,)`` structured arrays on the
quantized side and ``(n_blocks, 32)`` float32 on the float side.  The arithmetic is done in
float32 in the same order as ggml's reference code, so results are bit-identical.
"""
from __future__ import annotations

import numpy as np

from ..types import Type
from .layouts import (KVALUES_IQ4NL, KVALUES_MXFP4, bits_lsb_first, e8m0_to_fp32_half, empty_blocks, low_high_nibbles,
                      pack_nibbles)

f32 = np.float32


def _d(b: np.ndarray, field: str = "d") -> np.ndarray:
    return b[field].astype(f32)[:, None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return low_high_nibbles(qs).reshape(qs.shape[0], 32)


def _five_bit(b: np.ndarray) -> np.ndarray:
    return _nibbles(b["qs"]) | (bits_lsb_first(b["qh"], 32) << 4)


# -- dequantize ---------------------------------------------------------------------------

def dequant_q4_0(b: np.ndarray) -> np.ndarray:
    return _d(b) * (_nibbles(b["qs"]).astype(np.int8) - np.int8(8)).astype(f32)


def dequant_q4_1(b: np.ndarray) -> np.ndarray:
    return _d(b) * _nibbles(b["qs"]).astype(f32) + _d(b, "m")


def dequant_q5_0(b: np.ndarray) -> np.ndarray:
    return _d(b) * (_five_bit(b).astype(np.int8) - np.int8(16)).astype(f32)


def dequant_q5_1(b: np.ndarray) -> np.ndarray:
    return _d(b) * _five_bit(b).astype(f32) + _d(b, "m")


def dequant_q8_0(b: np.ndarray) -> np.ndarray:
    return b["qs"].astype(f32) * _d(b)


dequant_q8_1 = dequant_q8_0  # the extra field s = d * sum(qs) only speeds up dot products


def dequant_iq4_nl(b: np.ndarray) -> np.ndarray:
    return _d(b) * KVALUES_IQ4NL[_nibbles(b["qs"])].astype(f32)


def dequant_mxfp4(b: np.ndarray) -> np.ndarray:
    return KVALUES_MXFP4[_nibbles(b["qs"])].astype(f32) * e8m0_to_fp32_half(b["e"])[:, None]


# -- quantize (ggml's reference quantizers, bit for bit) ----------------------------------

def inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, f32(0), f32(1) / d).astype(f32)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude, keeping its sign (first one on ties, like ggml)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1, keepdims=True), axis=-1)


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf(): halves go away from zero (numpy's round goes to even)."""
    a = np.abs(x)
    fl = np.floor(a)
    return np.copysign(fl + (a - fl >= 0.5), x)


def _scale_offset_quant(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1: q = trunc((x - min) / d + 0.5) with d = (max - min) / (levels - 1)."""
    mn = x.min(axis=-1, keepdims=True)
    d = (x.max(axis=-1, keepdims=True) - mn) / f32(levels - 1)
    q = np.trunc((x - mn) * inverse(d) + f32(0.5)).astype(np.uint8).clip(0, levels - 1)
    return d, mn, q


def _symmetric_quant(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0: d = absmax / -(levels/2), q = trunc(x / d + levels/2 + 0.5)."""
    half = levels // 2
    d = _signed_absmax(x) / f32(-half)
    q = np.trunc(x * inverse(d) + f32(half + 0.5)).astype(np.uint8).clip(0, levels - 1)
    return d, q


def _pack_q5_high(q: np.ndarray) -> np.ndarray:
    return np.packbits((q >> 4).astype(np.uint8), axis=-1, bitorder="little").view("<u4")[:, 0]


def _quant_nibbles(x: np.ndarray, qtype: Type, levels: int, with_min: bool) -> np.ndarray:
    """Q4_0/Q5_0 (symmetric) and Q4_1/Q5_1 (with the block minimum): the low four bits of each
    value in nibbles, and for 32 levels the fifth bit in ``qh``."""
    if with_min:
        d, mn, q = _scale_offset_quant(x, levels)
    else:
        d, q = _symmetric_quant(x, levels)
    b = empty_blocks(len(x), qtype)
    b["d"] = d[:, 0]
    if with_min:
        b["m"] = mn[:, 0]
    if levels == 32:
        b["qh"] = _pack_q5_high(q)
    b["qs"] = pack_nibbles(q[:, :16], q[:, 16:])
    return b


def quant_q4_0(x: np.ndarray) -> np.ndarray:
    return _quant_nibbles(x, Type.Q4_0, 16, False)


def quant_q4_1(x: np.ndarray) -> np.ndarray:
    return _quant_nibbles(x, Type.Q4_1, 16, True)


def quant_q5_0(x: np.ndarray) -> np.ndarray:
    return _quant_nibbles(x, Type.Q5_0, 32, False)


def quant_q5_1(x: np.ndarray) -> np.ndarray:
    return _quant_nibbles(x, Type.Q5_1, 32, True)


def _q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = np.abs(x).max(axis=-1, keepdims=True) / f32(127)
    return d, round_half_away(x * inverse(d)).astype(np.int8)


def quant_q8_0(x: np.ndarray) -> np.ndarray:
    d, q = _q8(x)
    b = empty_blocks(len(x), Type.Q8_0)
    b["d"], b["qs"] = d[:, 0], q
    return b


def quant_q8_1(x: np.ndarray) -> np.ndarray:
    d, q = _q8(x)
    b = empty_blocks(len(x), Type.Q8_1)
    b["d"], b["qs"] = d[:, 0], q
    b["s"] = d[:, 0] * q.astype(np.int32).sum(axis=-1).astype(f32)
    return b


def quant_mxfp4(x: np.ndarray) -> np.ndarray:
    """quantize_row_mxfp4_ref: the block's exponent from its largest magnitude (floor(log2) - 2,
    so that 6 * 2**e covers it), each value the nearest of the doubled e2m1 values times half
    the scale, the first of equals."""
    x = np.asarray(x, dtype=f32)
    if x.shape[0] > 1 << 15:  # (the nearest-value search holds 16 candidates per value: in pieces)
        return np.concatenate([quant_mxfp4(x[i:i + (1 << 15)]) for i in range(0, x.shape[0], 1 << 15)])
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - f32(2) + f32(127), 0).astype(np.uint8)
    d = e8m0_to_fp32_half(e)
    err = np.abs(KVALUES_MXFP4.astype(f32)[None, None, :] * d[:, None, None] - x[:, :, None])
    idx = err.argmin(axis=2).astype(np.uint8)
    b = empty_blocks(x.shape[0], Type.MXFP4)
    b["e"] = e
    b["qs"] = pack_nibbles(idx[:, :16], idx[:, 16:])
    return b

"""Byte layouts of ggml's quantized blocks as numpy structured dtypes.

Viewing raw bytes through these dtypes names every field of a block (``d``, ``qs``,
``scales`` ...) so the (de)quantizers below read like the format's definition instead of
like byte arithmetic.  Field order and sizes are exactly ggml's ``block_*`` structs.
"""
from __future__ import annotations

import numpy as np

from ..types import QK_K, Type

F16 = "<f2"

LAYOUTS: dict[Type, np.dtype] = {
    Type.Q4_0: np.dtype([("d", F16), ("qs", "u1", 16)]),
    Type.Q4_1: np.dtype([("d", F16), ("m", F16), ("qs", "u1", 16)]),
    Type.Q5_0: np.dtype([("d", F16), ("qh", "<u4"), ("qs", "u1", 16)]),
    Type.Q5_1: np.dtype([("d", F16), ("m", F16), ("qh", "<u4"), ("qs", "u1", 16)]),
    Type.Q8_0: np.dtype([("d", F16), ("qs", "i1", 32)]),
    Type.Q8_1: np.dtype([("d", F16), ("s", F16), ("qs", "i1", 32)]),
    Type.Q2_K: np.dtype([("scales", "u1", QK_K // 16), ("qs", "u1", QK_K // 4), ("d", F16), ("dmin", F16)]),
    Type.Q3_K: np.dtype([("hmask", "u1", QK_K // 8), ("qs", "u1", QK_K // 4), ("scales", "u1", 12), ("d", F16)]),
    Type.Q4_K: np.dtype([("d", F16), ("dmin", F16), ("scales", "u1", 12), ("qs", "u1", QK_K // 2)]),
    Type.Q5_K: np.dtype([("d", F16), ("dmin", F16), ("scales", "u1", 12), ("qh", "u1", QK_K // 8),
                         ("qs", "u1", QK_K // 2)]),
    Type.Q6_K: np.dtype([("ql", "u1", QK_K // 2), ("qh", "u1", QK_K // 4), ("scales", "i1", QK_K // 16),
                         ("d", F16)]),
    Type.Q8_K: np.dtype([("d", "<f4"), ("qs", "i1", QK_K), ("bsums", "<i2", QK_K // 16)]),
    Type.IQ4_NL: np.dtype([("d", F16), ("qs", "u1", 16)]),
    Type.IQ4_XS: np.dtype([("d", F16), ("scales_h", "<u2"), ("scales_l", "u1", QK_K // 64),
                           ("qs", "u1", QK_K // 2)]),
    Type.MXFP4: np.dtype([("e", "u1"), ("qs", "u1", 16)]),
}

for _t, _dt in LAYOUTS.items():  # the layouts must agree with the type table
    assert _dt.itemsize == _t.type_size, (_t, _dt.itemsize)

# the non-linear 4-bit code book of IQ4_NL / IQ4_XS
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)


# MXFP4's e2m1 values, doubled (ggml's kvalues_mxfp4); the block's E8M0 scale is halved to match
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """2**(e - 128) as float32, ggml_e8m0_to_fp32_half's bits (e < 2: the subnormals)."""
    e = np.asarray(e, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def as_blocks(raw: np.ndarray, qtype: Type) -> np.ndarray:
    """View contiguous uint8 bytes as a 1-D array of ``qtype`` blocks."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size % qtype.type_size:
        raise ValueError(f"{qtype.name}: {raw.size} bytes is not a whole number of {qtype.type_size}-byte blocks")
    return raw.view(LAYOUTS[qtype])


def empty_blocks(n_blocks: int, qtype: Type) -> np.ndarray:
    return np.zeros(n_blocks, dtype=LAYOUTS[qtype])


def low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 2, n): low nibbles first, then high nibbles (ggml's order)."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def pack_nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo.astype(np.uint8) & 0x0F) | (hi.astype(np.uint8) << 4)


def k4_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte, 6-bit scale/min table of Q4_K/Q5_K into two (n, 8) uint8 arrays.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales/mins 4-7 take their
    low 4 bits from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7.
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def k4_pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of :func:`k4_scales_mins` for 6-bit values in (n, 8) arrays."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def q3k_scales(scales: np.ndarray) -> np.ndarray:
    """Unpack Q3_K's 16 signed 6-bit scales: low nibbles from bytes 0-7, top 2 bits from 8-11."""
    low = np.concatenate([scales[:, 0:8] & 0x0F, scales[:, 0:8] >> 4], axis=-1)
    high = (scales[:, 8:12][:, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 0x03
    return (low | (high.reshape(-1, 16) << 4)).astype(np.int8) - np.int8(32)


def bits_lsb_first(words: np.ndarray, n_bits: int) -> np.ndarray:
    """(..., ) unsigned ints -> (..., n_bits) array of their bits, least significant first."""
    shifts = np.arange(n_bits, dtype=words.dtype)
    return ((words[..., None] >> shifts) & 1).astype(np.uint8)

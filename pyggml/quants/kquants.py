"""The 256-element super-block formats (k-quants) and IQ4_XS.

Dequantizers are bit-identical to ggml's (same float32 operation order).  The quantizers
for Q4_K, Q6_K and Q8_K are our own vectorized versions of ggml's ideas: a small search
over candidate scales per sub-block that minimizes squared error, then the sub-block
scales themselves quantized against one super-block scale.
"""
from __future__ import annotations

import numpy as np

from ..types import QK_K, Type
from .layouts import (KVALUES_IQ4NL, empty_blocks, k4_pack_scales_mins, k4_scales_mins, low_high_nibbles,
                      pack_nibbles, q3k_scales)
from .legacy import inverse

f32 = np.float32


def _d(b: np.ndarray, field: str = "d") -> np.ndarray:
    return b[field].astype(f32)[:, None]


def _crumbs(qs: np.ndarray, n_groups: int) -> np.ndarray:
    """Q2_K/Q3_K 2-bit fields: each 32-byte group holds 4 planes (shift 0, 2, 4, 6)."""
    planes = qs.reshape(-1, n_groups, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    return (planes & 3).reshape(-1, QK_K)


# -- dequantize ---------------------------------------------------------------------------

def dequant_q2_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    dl = (_d(b) * (b["scales"] & 0x0F).astype(f32)).reshape(n, 16, 1)
    ml = (_d(b, "dmin") * (b["scales"] >> 4).astype(f32)).reshape(n, 16, 1)
    q = _crumbs(b["qs"], 2).reshape(n, 16, 16).astype(f32)
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q3_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    dl = (_d(b) * q3k_scales(b["scales"]).astype(f32)).reshape(n, 16, 1)
    low = _crumbs(b["qs"], 2)
    # hmask bit (4*half + plane) of byte l is the high bit of element half*128 + plane*32 + l;
    # a cleared bit means "subtract 4"
    hbits = (b["hmask"].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = low.astype(np.int8) - ((hbits.reshape(n, QK_K) ^ 1) << 2).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(f32)).reshape(n, QK_K)


def _k4_scale_and_min(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = k4_scales_mins(b["scales"])
    return (_d(b) * sc.astype(f32))[:, :, None], (_d(b, "dmin") * mn.astype(f32))[:, :, None]


def dequant_q4_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d, m = _k4_scale_and_min(b)
    q = low_high_nibbles(b["qs"].reshape(n, 4, 32)).reshape(n, 8, 32).astype(f32)
    return (d * q - m).reshape(n, QK_K)


def dequant_q5_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d, m = _k4_scale_and_min(b)
    low = low_high_nibbles(b["qs"].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = (b["qh"].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (d * (low | (high << 4)).astype(f32) - m).reshape(n, QK_K)


def dequant_q6_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    d = (_d(b) * b["scales"].astype(f32)).reshape(n, 16, 1)
    # per 128-element half: ql bytes 0-63 give elements 0-63 (low nibble) and 64-127 (high)
    low = low_high_nibbles(b["ql"].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    high = (b["qh"].reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return (d * q.reshape(n, 16, 16).astype(f32)).reshape(n, QK_K)


def dequant_q8_k(b: np.ndarray) -> np.ndarray:
    return b["qs"].astype(f32) * b["d"][:, None]


def dequant_iq4_xs(b: np.ndarray) -> np.ndarray:
    n = len(b)
    lo = low_high_nibbles(b["scales_l"]).transpose(0, 2, 1).reshape(n, 8)
    hi = (b["scales_h"][:, None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (lo | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    dl = (_d(b) * ls.astype(f32))[:, :, None]
    q = low_high_nibbles(b["qs"].reshape(n, 8, 16)).reshape(n, 8, 32)
    return (dl * KVALUES_IQ4NL[q].astype(f32)).reshape(n, QK_K)


# -- quantize -------------------------------------------------------------------------------

def quant_q8_k(x: np.ndarray) -> np.ndarray:
    """Q8_K as ggml: d = absmax / -127 (sign of the largest element), bsums per 16."""
    amax = np.take_along_axis(x, np.abs(x).argmax(axis=-1, keepdims=True), axis=-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax == 0, f32(0), f32(-127) / amax).astype(f32)
    q = np.minimum(np.rint(iscale * x), 127).astype(np.int8)  # ggml's nearest_int: half to even
    b = empty_blocks(len(x), Type.Q8_K)
    b["qs"] = q
    b["bsums"] = q.reshape(-1, 16, 16).astype(np.int16).sum(axis=-1, dtype=np.int16)
    b["d"] = np.where(amax[:, 0] == 0, f32(0), inverse(iscale[:, 0]))
    return b


def _fit_scale_min(x: np.ndarray, w: np.ndarray, nmax: int, n_steps: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``x``: scale s >= 0 and offset m >= 0 with x ~ s*q - m, q in [0, nmax].

    Like ggml's make_qkx2_quants: try scales around (max - min)/nmax, and for each
    candidate quantization solve the weighted least-squares (s, m); keep the best.
    """
    xmin = np.minimum(x.min(axis=-1, keepdims=True), 0)
    xmax = x.max(axis=-1, keepdims=True)
    span = np.maximum(xmax - xmin, 1e-30)
    best_s = span / nmax
    best_m = -xmin
    best_err = (w * (best_s * np.clip(np.rint((x - xmin) / best_s), 0, nmax) + xmin - x) ** 2).sum(-1, keepdims=True)
    sw = w.sum(-1, keepdims=True)
    for step in range(n_steps + 1):
        iscale = (nmax - 1 + 0.1 * step) / span  # ggml: rmin = -1, rdelta = 0.1
        q = np.clip(np.rint(iscale * (x - xmin)), 0, nmax)
        sq, sq2, sx, sqx = (w * q).sum(-1, keepdims=True), (w * q * q).sum(-1, keepdims=True), \
            (w * x).sum(-1, keepdims=True), (w * q * x).sum(-1, keepdims=True)
        det = sw * sq2 - sq * sq
        ok = det > 0
        s = np.where(ok, (sw * sqx - sx * sq) / np.where(ok, det, 1), best_s)
        mneg = np.where(ok, (sq2 * sx - sq * sqx) / np.where(ok, det, 1), -best_m)  # x ~ s*q + mneg
        s_pos = s > 0
        mneg = np.minimum(mneg, 0)  # the format's offset is subtracted and non-negative
        err = (w * (s * q + mneg - x) ** 2).sum(-1, keepdims=True)
        better = ok & s_pos & (err < best_err)
        best_s = np.where(better, s, best_s)
        best_m = np.where(better, -mneg, best_m)
        best_err = np.where(better, err, best_err)
    return best_s[..., 0], best_m[..., 0]


def _quantize_sub_scales(values: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize non-negative per-sub-block values (n, k) to ints in [0, nmax] with one scale."""
    vmax = values.max(axis=-1, keepdims=True)
    inv = np.where(vmax > 0, nmax / np.where(vmax > 0, vmax, 1), 0)
    q = np.clip(np.rint(values * inv), 0, nmax).astype(np.uint8)
    return q, np.where(vmax > 0, vmax / nmax, 0)[:, 0].astype(f32)


def quant_q4_k(x: np.ndarray) -> np.ndarray:
    n = len(x)
    sub = x.reshape(n, 8, 32).astype(np.float64)
    # ggml weights each element by av_x + |x| so large weights are fitted more closely
    av_x = np.sqrt((sub.reshape(n, -1) ** 2).mean(-1))[:, None, None]
    scales, mins = _fit_scale_min(sub, av_x + np.abs(sub), 15)
    qsc, d = _quantize_sub_scales(scales, 63)
    qmn, dmin = _quantize_sub_scales(mins, 63)
    b = empty_blocks(n, Type.Q4_K)
    b["d"], b["dmin"] = d, dmin
    b["scales"] = k4_pack_scales_mins(qsc, qmn)
    # requantize against the scales as they will be decoded (fp16 d times 6-bit scale)
    eff_s, eff_m = _k4_effective(b)
    q = np.clip(np.rint((sub + eff_m[..., None]) * _safe_inv(eff_s)[..., None]), 0, 15).astype(np.uint8)
    b["qs"] = pack_nibbles(q[:, 0::2], q[:, 1::2]).reshape(n, 128)
    return b


def _k4_effective(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = k4_scales_mins(b["scales"])
    return (b["d"].astype(np.float64)[:, None] * sc), (b["dmin"].astype(np.float64)[:, None] * mn)


def _safe_inv(s: np.ndarray) -> np.ndarray:
    return np.where(s != 0, 1 / np.where(s != 0, s, 1), 0)


def quant_q6_k(x: np.ndarray) -> np.ndarray:
    n = len(x)
    sub = x.reshape(n, 16, 16).astype(np.float64)
    # symmetric per-16 scale, searched like ggml's make_qx_quants (weights x^2)
    amax_signed = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], axis=-1)
    best_s = amax_signed / -32
    w = sub * sub
    best_err = np.full(best_s.shape, np.inf)
    for step in range(-9, 10):
        iscale = np.where(amax_signed != 0, -(32 + 0.1 * step) / np.where(amax_signed != 0, amax_signed, 1), 0)
        q = np.clip(np.rint(iscale * sub), -32, 31)
        sqx, sq2 = (w * q * sub).sum(-1, keepdims=True), (w * q * q).sum(-1, keepdims=True)
        s = np.where(sq2 > 0, sqx / np.where(sq2 > 0, sq2, 1), 0)
        err = (w * (s * q - sub) ** 2).sum(-1, keepdims=True)
        better = err < best_err
        best_s, best_err = np.where(better, s, best_s), np.where(better, err, best_err)
    best_s = best_s[..., 0]
    smax = np.take_along_axis(best_s, np.abs(best_s).argmax(-1)[:, None], axis=-1)
    inv = np.where(smax != 0, -128 / np.where(smax != 0, smax, 1), 0)
    qsc = np.clip(np.rint(best_s * inv), -128, 127).astype(np.int8)
    b = empty_blocks(n, Type.Q6_K)
    b["d"] = np.where(smax[:, 0] != 0, smax[:, 0] / -128, 0)
    b["scales"] = qsc
    eff = b["d"].astype(np.float64)[:, None] * qsc
    q = (np.clip(np.rint(sub * _safe_inv(eff)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    b["ql"] = pack_nibbles(q[:, :, 0:2], q[:, :, 2:4]).reshape(n, 128)
    high = (q >> 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    b["qh"] = np.bitwise_or.reduce(high, axis=2).reshape(n, 64)
    return b

"""Quantize and dequantize ggml tensor data, with the call shape of ``gguf.quants``.

``dequantize(data, qtype)``: ``data`` holds raw bytes (uint8) whose last axis is a whole
number of blocks; the result is float32 with the last axis in elements.
``quantize(x, qtype)``: float data whose last axis is a multiple of the block size; the
result is uint8 bytes.  ``qtype`` may be a :class:`pyggml.Type`, a
``gguf.GGMLQuantizationType`` or an int.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..types import Type, as_type
from . import kquants, legacy
from .layouts import LAYOUTS, as_blocks

_DEQUANT: dict[Type, Callable[[np.ndarray], np.ndarray]] = {
    Type.Q4_0: legacy.dequant_q4_0,
    Type.Q4_1: legacy.dequant_q4_1,
    Type.Q5_0: legacy.dequant_q5_0,
    Type.Q5_1: legacy.dequant_q5_1,
    Type.Q8_0: legacy.dequant_q8_0,
    Type.Q8_1: legacy.dequant_q8_1,
    Type.IQ4_NL: legacy.dequant_iq4_nl,
    Type.MXFP4: legacy.dequant_mxfp4,
    Type.Q2_K: kquants.dequant_q2_k,
    Type.Q3_K: kquants.dequant_q3_k,
    Type.Q4_K: kquants.dequant_q4_k,
    Type.Q5_K: kquants.dequant_q5_k,
    Type.Q6_K: kquants.dequant_q6_k,
    Type.Q8_K: kquants.dequant_q8_k,
    Type.IQ4_XS: kquants.dequant_iq4_xs,
}

_QUANT: dict[Type, Callable[[np.ndarray], np.ndarray]] = {
    Type.Q4_0: legacy.quant_q4_0,
    Type.Q4_1: legacy.quant_q4_1,
    Type.Q5_0: legacy.quant_q5_0,
    Type.Q5_1: legacy.quant_q5_1,
    Type.Q8_0: legacy.quant_q8_0,
    Type.Q8_1: legacy.quant_q8_1,
    Type.MXFP4: legacy.quant_mxfp4,
    Type.Q8_K: kquants.quant_q8_k,
    Type.Q4_K: kquants.quant_q4_k,
    Type.Q6_K: kquants.quant_q6_k,
}

QUANTIZABLE = frozenset(_QUANT) | {Type.F32, Type.F16, Type.BF16}
DEQUANTIZABLE = frozenset(_DEQUANT) | {Type.F32, Type.F16, Type.BF16}

# rows are processed in chunks so temporaries stay small on big tensors
_CHUNK_BLOCKS = 1 << 16


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaNs kept quiet (ggml_compute_fp32_to_bf16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16
    return np.where(nan, (u >> 16) | 64, rounded).astype(np.uint16)


def dequantize(data: np.ndarray, qtype: object) -> np.ndarray:
    qtype = as_type(qtype)
    data = np.asarray(data)
    if qtype == Type.F32:
        return data.view(np.float32) if data.dtype == np.uint8 else data.astype(np.float32, copy=False)
    if qtype == Type.F16:
        return (data.view(np.float16) if data.dtype == np.uint8 else data).astype(np.float32)
    if qtype == Type.BF16:
        return bf16_to_f32(data.view(np.uint16) if data.dtype == np.uint8 else data)
    fn = _DEQUANT.get(qtype)
    if fn is None:
        raise NotImplementedError(f"dequantization of {qtype.name} is not implemented")
    shape = data.shape
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
        shape = data.shape
    if shape[-1] % qtype.type_size:
        raise ValueError(f"{qtype.name}: a row of {shape[-1]} bytes is not a whole number of blocks")
    blocks = as_blocks(data, qtype)
    out = np.empty((blocks.size, qtype.block_size), dtype=np.float32)
    for i in range(0, blocks.size, _CHUNK_BLOCKS):
        out[i:i + _CHUNK_BLOCKS] = fn(blocks[i:i + _CHUNK_BLOCKS])
    return out.reshape(*shape[:-1], shape[-1] // qtype.type_size * qtype.block_size)


def quantize(x: np.ndarray, qtype: object) -> np.ndarray:
    qtype = as_type(qtype)
    x = np.asarray(x)
    if qtype == Type.F32:
        return x.astype(np.float32, copy=False)
    if qtype == Type.F16:
        return x.astype(np.float16, copy=False)
    if qtype == Type.BF16:
        return f32_to_bf16(x).view(np.uint8).reshape(*x.shape[:-1], x.shape[-1] * 2)
    fn = _QUANT.get(qtype)
    if fn is None:
        raise NotImplementedError(f"quantization to {qtype.name} is not implemented")
    if x.shape[-1] % qtype.block_size:
        raise ValueError(f"{qtype.name}: a row of {x.shape[-1]} elements is not a multiple of "
                         f"the block size {qtype.block_size}")
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, qtype.block_size)
    out = np.empty(len(blocks), dtype=LAYOUTS[qtype])
    for i in range(0, len(blocks), _CHUNK_BLOCKS):
        out[i:i + _CHUNK_BLOCKS] = fn(blocks[i:i + _CHUNK_BLOCKS])
    return out.view(np.uint8).reshape(*x.shape[:-1], x.shape[-1] // qtype.block_size * qtype.type_size)


__all__ = ["dequantize", "quantize", "QUANTIZABLE", "DEQUANTIZABLE", "bf16_to_f32", "f32_to_bf16"]

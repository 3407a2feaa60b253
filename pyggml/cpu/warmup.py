"""Load every numba kernel of the CPU backend once (from numba's on-disk cache after the first
run on a machine), so that the first real request does not pay for it.

A server calls this at start-up; bench/generate.py calls it to measure what the runtime holds
before a model is loaded.
"""
from __future__ import annotations

import numpy as np

from ..types import Type
from . import nn
from .activations import quantize
from .kinds import DECODER, EXACT, Act
from .qdecode import F16_TABLE, decode_rows, f16_values, fused_matmul
from .qdot import exact_quant_matmul


def warm_up() -> None:
    f32 = np.float32
    x = np.linspace(-1, 1, 2 * 256, dtype=f32).reshape(2, 256)
    for kind in (Act.Q8_0, Act.Q8_1, Act.Q8_K):
        quantize(x, int(kind))
    w = np.zeros((2, Type.Q4_K.row_size(256)), dtype=np.uint8)
    yq, yd, ys = quantize(x, int(Act.Q8_K))
    exact_quant_matmul(int(EXACT[Type.Q4_K]), w, yq, yd, ys, np.empty((2, 2), dtype=f32), F16_TABLE)
    decode_rows(int(DECODER[Type.Q4_K]), w, np.empty((2, 256), dtype=f32), F16_TABLE)
    fused_matmul(int(DECODER[Type.Q4_K]), w, x, np.empty((2, 2), dtype=f32), F16_TABLE)
    f16_values(np.zeros((1, 1, 1, 4), dtype=np.uint16), F16_TABLE, np.empty((1, 1, 1, 4), dtype=f32))
    out = np.empty_like(x)
    nn.softmax_rows(x.copy())
    nn.rms_norm(x, 1e-6, out)
    nn.silu(x, out)
    nn.swiglu(x, x, out)
    nn.gelu(x, out)
    nn.geglu(x, x, out)
    cos, sin = nn.rope_cache(np.arange(2), 16, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 4096, np.ones(1, dtype=f32), False)
    q = x.reshape(1, 2, 8, 32)[:, :, :1, :16].copy()
    nn.rope_rotate(q, np.empty_like(q), cos, sin, 16, True)
    qa = np.ones((1, 2, 64), dtype=f32)
    nn.attention(qa, qa, qa, np.zeros((2, 2), dtype=f32), 0.125, 0.0, np.empty((2, 1, 64), dtype=f32))
    nn.attention(qa[:, :1], qa, qa, np.zeros((1, 2), dtype=f32), 0.125, 0.0, np.empty((1, 1, 64), dtype=f32))

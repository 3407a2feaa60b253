"""Load every numba kernel of the CPU backend once (from numba's on-disk cache after the first
run on a machine), so that the first real request does not pay for it.

A server calls this at start-up; bench/generate.py calls it to measure what the runtime holds
before a model is loaded.  On a machine where the kernels were never compiled,
:func:`compile_in_parallel` compiles them in a few processes at once (numba compiles one
function at a time per process, and the products' kernel alone takes most of a minute's
work), each writing numba's cache, which this process then loads.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from ..types import Type
from . import nn
from .activations import quantize
from .kinds import DECODER, EXACT, Act
from .qdecode import F16_TABLE, decode_rows, f16_values, fused_matmul
from .qdot import exact_quant_matmul
from .qmatmul import frozen

f32 = np.float32


def _products() -> None:
    x = np.linspace(-1, 1, 2 * 256, dtype=f32).reshape(2, 256)
    w = frozen(np.zeros((2, Type.Q4_K.row_size(256)), dtype=np.uint8))  # as weights arrive
    yq, yd, ys = quantize(x, int(Act.Q8_K))
    exact_quant_matmul(int(EXACT[Type.Q4_K]), w, yq, yd, ys, np.empty((2, 2), dtype=f32), F16_TABLE,
                       np.array([0, 2], dtype=np.int64))


def _decoders() -> None:
    x = np.linspace(-1, 1, 2 * 256, dtype=f32).reshape(2, 256)
    for kind in (Act.Q8_0, Act.Q8_1, Act.Q8_K):
        quantize(x, int(kind))  # a row or two: in this thread
        quantize(np.concatenate([x, x]), int(kind))  # more: in parallel
    w = frozen(np.zeros((2, Type.Q4_K.row_size(256)), dtype=np.uint8))
    decode_rows(int(DECODER[Type.Q4_K]), w, np.empty((2, 256), dtype=f32), F16_TABLE)
    fused_matmul(int(DECODER[Type.Q4_K]), w, x, np.empty((2, 2), dtype=f32), F16_TABLE)
    f16_values(np.zeros((1, 1, 1, 4), dtype=np.uint16), F16_TABLE, np.empty((1, 1, 1, 4), dtype=f32))


def _layers() -> None:
    x = np.linspace(-1, 1, 2 * 256, dtype=f32).reshape(2, 256)
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
    q = np.ones((1, 2, 64), dtype=f32)
    cells = np.zeros((2, 64), dtype=np.uint16)  # an F16 cache's cells, as FLASH_ATTN_EXT reads them
    mask = np.zeros((2, 2), dtype=f32)
    nn.attention_cells(q, cells, cells, 1, mask, f32(0.125), f32(0.0), np.empty((2, 1, 64), dtype=f32))
    nn.seen_cells(mask)
    nn.top_k_rows(x, 2, np.empty((2, 2), dtype=np.int64))


PARTS = (_products, _decoders, _layers)  # the first is the largest: it starts first


def warm_up() -> None:
    for part in PARTS:
        part()


def compile_in_parallel(timeout: float = 600.0) -> None:
    """Compile the parts in processes of their own, then load them here.  Should a process fail,
    what it did not compile is compiled here by the final warm_up."""
    env = {**os.environ, "PYGGML_WARM_UP_PART": ""}
    procs = []
    for i in range(len(PARTS)):
        env["PYGGML_WARM_UP_PART"] = str(i)
        procs.append(subprocess.Popen([sys.executable, "-c", "import pyggml.cpu.warmup as w; w._part_from_env()"],
                                      env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
    warm_up()


def _part_from_env() -> None:
    PARTS[int(os.environ["PYGGML_WARM_UP_PART"])]()

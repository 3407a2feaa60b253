"""Matrix products with quantized weights on the CPU.

The weight types of real models go through qdot.py, which reproduces ggml's integer block dot
products and their float accumulation exactly.  The rest (F16, IQ4_NL/IQ4_XS, Q2_K, Q3_K) are
decoded row by row and dotted with the activations rounded the way ggml holds them: equal to
ggml's up to float summation order.  For few columns (token-by-token decoding) each weight row
is decoded into an L1-sized scratch vector and dotted with every column at once; for many
columns rows are decoded a tile at a time and multiplied with BLAS.
"""
from __future__ import annotations

import numpy as np

from ..types import Type
from .activations import activation_values, quantize
from .kinds import DECODER, EXACT, VEC_DOT, Act, Fmt
from .qdecode import F16_TABLE, decode_rows, fused_matmul
from .qdot import exact_quant_matmul

# up to this many columns the fused decode+dot kernel beats decode-then-BLAS
FUSED_MAX_COLS = 16
TILE_ROWS = 1024


def frozen(w: np.ndarray) -> np.ndarray:
    """Weight rows as a read-only array.  They come read-only from a mapped GGUF file and writable
    from a buffer (an RPC server's, a test's); numba compiles a kernel once for each, and the
    products' kernel takes it tens of seconds, so every caller hands them over the same way."""
    if w.flags.writeable:
        w = w.view()
        w.flags.writeable = False
    return w


def dequantize_rows(w: np.ndarray, qtype: Type, k: int) -> np.ndarray:
    """Decode quantized rows (uint8 [M, row_bytes]) to float32 [M, k]."""
    out = np.empty((w.shape[0], k), dtype=np.float32)
    if w.shape[0]:
        decode_rows(int(DECODER[qtype]), frozen(np.ascontiguousarray(w)), out, F16_TABLE)
    return out


def quant_matmul(w: np.ndarray, qtype: Type, x: np.ndarray) -> np.ndarray:
    """x [N, K] float32 times the transpose of quantized w [M, row_bytes] -> [N, M] float32."""
    n_cols, k = x.shape
    m_rows = w.shape[0]
    if m_rows == 0 or n_cols == 0:
        return np.zeros((n_cols, m_rows), dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = frozen(w)
    kind = int(VEC_DOT.get(qtype, Act.F32))
    out = np.empty((n_cols, m_rows), dtype=np.float32)
    if qtype in EXACT:
        yq, yd, ys = quantize(x, kind)
        exact = Fmt.Q4_K_X8 if qtype == Type.Q4_K and m_rows % 8 == 0 else EXACT[qtype]
        exact_quant_matmul(int(exact), w, yq, yd, ys, out, F16_TABLE)
        return out
    x = activation_values(x, kind)
    dec = int(DECODER[qtype])
    if n_cols <= FUSED_MAX_COLS:
        fused_matmul(dec, w, x, out, F16_TABLE)
        return out
    # BLAS writes each tile's result into contiguous rows of the transposed output
    out_t = np.empty((m_rows, n_cols), dtype=np.float32)
    tile = np.empty((min(TILE_ROWS, m_rows), k), dtype=np.float32)
    for start in range(0, m_rows, TILE_ROWS):
        rows = w[start:start + TILE_ROWS]
        t = tile[:len(rows)]
        decode_rows(dec, rows, t, F16_TABLE)
        np.matmul(t, x.T, out=out_t[start:start + len(rows)])
    return np.ascontiguousarray(out_t.T)


def supports(qtype: Type) -> bool:
    return qtype in DECODER

"""Matrix products with quantized weights on the CPU.

The weight types of real models go through qdot.py, which reproduces ggml's integer block dot
products and their float accumulation exactly.  The rest (F16, IQ4_NL/IQ4_XS, Q2_K, Q3_K) are
decoded row by row and dotted with the activations rounded the way ggml holds them: equal to
ggml's up to float summation order.  For few columns (token-by-token decoding) each weight row
is decoded into an L1-sized scratch vector and dotted with every column at once; for many
columns rows are decoded a tile at a time and multiplied with BLAS.

A product is two steps, as in ggml (``from_float`` into the weight type's ``vec_dot_type``,
then the dots): :meth:`QuantProduct.activations` and calling the product.  A graph plan that
multiplies one activation with several weights of the same type (attention's Q, K and V; the
gate and up of a feed-forward) converts the activation once and hands it to each product.
"""
from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass

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
    from a buffer (an RPC server's, a test's); numba compiles a kernel once for each, and a
    product's kernel takes seconds, so every caller hands them over the same way."""
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


@functools.cache
def whole(n_cols: int) -> np.ndarray:
    """The runs of a product whose columns are one batch: [0, n_cols] (made once per width:
    a decode step makes a few hundred products)."""
    r = np.array([0, n_cols], dtype=np.int64)
    r.flags.writeable = False
    return r


def product_format(qtype: Type, m_rows: int) -> Fmt:
    """The block format an exact weight type's product takes: llama.cpp repacks Q4_K weights of a
    multiple of 8 rows (and multiplies them with other kernels)."""
    return Fmt.Q4_K_X8 if qtype == Type.Q4_K and m_rows % 8 == 0 else EXACT[qtype]


class ProductStep(enum.Enum):
    TABLE = "calls in the plan's table, run with their neighbours' in one compiled call"
    CALL = "one kernel call per step, its arguments found when bound"
    CALL_COPY = "computed into an array of its own, then copied into the strided result"
    PER_MATRIX = "one product per matrix of stacked or broadcast weights"
    FLOAT_RUNS = "numpy's matmul, one product per run of columns"
    FLOAT = "numpy's matmul over the broadcast matrices"


class ProductKernel(enum.Enum):
    EXACT = "ggml's integer block dots (qdot.py), each column in blockdot.column_format's format"
    FUSED = "each weight row decoded and dotted with every column (qdecode.fused_matmul)"
    DECODED_BLAS = "weight rows decoded a tile at a time and multiplied by BLAS"
    BLAS = "numpy's matmul of the float values"


@dataclass(frozen=True)
class Layout:
    one_matrix: bool  # the weights are one matrix (ne2 = ne3 = 1) whose rows lie one after another
    out_rows: bool    # the result's rows lie one after another (C-contiguous)
    x_rows: bool      # the activations are F32 rows one after another


@dataclass(frozen=True)
class ProductPlan:
    step: ProductStep
    kernel: ProductKernel
    fmt: Fmt | None = None  # the exact kernel's block format (Q4_K_X8: repacked Q4_K)


def choose_product(qtype: Type, m_rows: int, layout: Layout, n_cols: int, runs: bool) -> ProductPlan:
    """How the CPU computes a MUL_MAT of ``m_rows`` weight rows of ``qtype`` with ``n_cols``
    columns (a run's, where ``runs``: every run is computed as a product of its columns alone).

    The kernel, by the weights' type:

    | weights                                  | columns            | kernel       | format                    |
    | ---------------------------------------- | ------------------ | ------------ | ------------------------- |
    | not read as stored (F32, BF16 ...)       | any                | BLAS         |                           |
    | exact (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K ... MXFP4) | any          | EXACT        | product_format: Q4_K_X8 for Q4_K of a multiple of 8 rows |
    | the others read as stored (F16, IQ4 ...) | up to FUSED_MAX_COLS | FUSED      |                           |
    | the same                                 | more               | DECODED_BLAS |                           |

    The step, by the layout (the first row that holds):

    | weights                    | layout                                          | step       |
    | -------------------------- | ----------------------------------------------- | ---------- |
    | not read as stored         | runs                                            | FLOAT_RUNS |
    | not read as stored         | no runs                                         | FLOAT      |
    | read as stored             | not one matrix                                  | PER_MATRIX |
    | EXACT, rows and columns    | one matrix, result rows, F32 activation rows    | TABLE      |
    | read as stored             | one matrix, result rows                         | CALL       |
    | read as stored             | one matrix, a strided result                    | CALL_COPY  |

    Within the EXACT kernel, each column's format is blockdot.column_format's: repacked Q4_K's
    gemm for whole fours of columns, the tiled K-quant kernels from BatchRules.tiled_min_cols
    columns on; until a format's tiled rows are compiled (warmup's deferred parts) its columns
    are taken one at a time, with the same bits.  Every choice is llama.cpp's for the same
    weights and columns, so the bits are llama.cpp's."""
    if not qtype.has_vec_dot:
        return ProductPlan(ProductStep.FLOAT_RUNS if runs else ProductStep.FLOAT, ProductKernel.BLAS)
    fmt = None
    if qtype in EXACT:
        kernel, fmt = ProductKernel.EXACT, product_format(qtype, m_rows)
    else:
        kernel = ProductKernel.FUSED if n_cols <= FUSED_MAX_COLS else ProductKernel.DECODED_BLAS
    if not layout.one_matrix:
        step = ProductStep.PER_MATRIX
    elif kernel == ProductKernel.EXACT and layout.out_rows and layout.x_rows and m_rows > 0 and n_cols > 0:
        step = ProductStep.TABLE
    else:
        step = ProductStep.CALL if layout.out_rows else ProductStep.CALL_COPY
    return ProductPlan(step, kernel, fmt)


class QuantProduct:
    """x [N, K] float32 times the transpose of quantized weight rows w (uint8 [M, row_bytes]),
    the weight's kernel chosen once."""

    def __init__(self, w: np.ndarray, qtype: Type) -> None:
        if not w.flags.c_contiguous:  # a copy made here would not follow the tensor's bytes in a plan
            raise ValueError("QuantProduct: the weight rows must be C-contiguous")
        self.w = frozen(w)
        self.qtype = qtype
        self.m_rows = w.shape[0]
        self.kind = int(VEC_DOT.get(qtype, Act.F32))
        self.exact = qtype in EXACT
        if self.exact:
            self.fmt = int(product_format(qtype, self.m_rows))  # (its kernels made when a product is: qdot)
        else:
            self.dec = int(DECODER[qtype])

    @property
    def activation_key(self) -> tuple[int, bool]:
        """Products whose keys are equal take the same activations."""
        return self.kind, self.exact

    def activations(self, x: np.ndarray):
        """x in the form this product multiplies (ggml's vec_dot_type): quantized blocks for the
        exact types, the float values ggml would hold for the others."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        return quantize(x, self.kind) if self.exact else activation_values(x, self.kind)

    def bound(self, out: np.ndarray) -> Callable[[tuple, np.ndarray | None], None] | None:
        """``self(acts, out, runs)`` for this ``out`` (C-contiguous) as one kernel call, its
        arguments found now; None where __call__ has more to do than call the kernel.  (A
        plan's products are calls of its table instead: kernels.quant_table_step.)"""
        if not self.exact or self.m_rows == 0 or out.shape[0] == 0:
            return None
        fmt, w, every = self.fmt, self.w, whole(out.shape[0])
        return lambda acts, runs=None: exact_quant_matmul(fmt, w, *acts, out, every if runs is None else runs)

    def __call__(self, acts, out: np.ndarray, runs: np.ndarray | None = None) -> None:
        """out [N, M] (C-contiguous float32) = the product with ``activations(x)``; with ``runs``
        (int64 [first column of each run..., N], checked), each run of columns computed as a
        product of its columns alone (ops.mul_mat)."""
        if self.m_rows == 0 or out.shape[0] == 0:
            out[...] = 0.0
            return
        if self.exact:
            self.bound(out)(acts, runs)
            return
        w = self.w
        if runs is not None and runs.size > 2:
            for r0, r1 in zip(runs[:-1], runs[1:]):
                if r1 > r0:
                    self(acts[r0:r1], out[r0:r1])
            return
        x = acts
        if x.shape[0] <= FUSED_MAX_COLS:  # (choose_product's FUSED)
            fused_matmul(self.dec, w, x, out, F16_TABLE)
            return
        # BLAS writes each tile's result into contiguous rows of the transposed output
        out_t = np.empty((self.m_rows, x.shape[0]), dtype=np.float32)
        tile = np.empty((min(TILE_ROWS, self.m_rows), x.shape[1]), dtype=np.float32)
        for start in range(0, self.m_rows, TILE_ROWS):
            rows = w[start:start + TILE_ROWS]
            t = tile[:len(rows)]
            decode_rows(self.dec, rows, t, F16_TABLE)
            np.matmul(t, x.T, out=out_t[start:start + len(rows)])
        out[...] = out_t.T


def quant_matmul(w: np.ndarray, qtype: Type, x: np.ndarray) -> np.ndarray:
    """x [N, K] float32 times the transpose of quantized w [M, row_bytes] -> [N, M] float32."""
    product = QuantProduct(np.ascontiguousarray(w), qtype)
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    if x.shape[0]:
        product(product.activations(x), out)
    return out


def supports(qtype: Type) -> bool:
    return qtype in DECODER


assert set(DECODER) == {t for t in Type if t.has_vec_dot}, "a type with a vec_dot the CPU cannot decode"

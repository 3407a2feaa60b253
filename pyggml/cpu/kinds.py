"""The numberings the CPU kernels dispatch on, one ``IntEnum`` each.

A compiled kernel cannot take a Python function or a type object as its argument and be
cached, so the products and decoders are chosen by a small integer; numba reads the members
of these enums as constants, so ``kind == Fmt.Q4_K_X8`` costs what ``kind == 8`` did, and a
number means one thing wherever it appears.

- :class:`Act`: the form an activation row takes for a weight type's product (ggml's
  ``vec_dot_type``), activations.py.
- :class:`Dec`: the row decoders of qdecode.py (decode-then-dot products, GET_ROWS).
- :class:`Fmt`: the block formats that blockdot.py and qdot.py multiply straight from the GGUF
  blocks, with the variants llama.cpp's batched kernels compute.
"""
from __future__ import annotations

import enum

from ..types import Type


class Act(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q8_0 = 2
    Q8_1 = 3
    Q8_K = 4


class Dec(enum.IntEnum):
    Q4_0 = 0
    Q4_1 = 1
    Q5_0 = 2
    Q5_1 = 3
    Q8_0 = 4
    Q8_1 = 5
    IQ4_NL = 6
    Q2_K = 7
    Q3_K = 8
    Q4_K = 9
    Q5_K = 10
    Q6_K = 11
    F16 = 12
    Q8_K = 13
    IQ4_XS = 14
    MXFP4 = 15


class Fmt(enum.IntEnum):
    Q4_0 = 0      # the 32-element block types: Q4_0 .. Q8_0
    Q4_1 = 1
    Q5_0 = 2
    Q5_1 = 3
    Q8_0 = 4
    Q4_K = 5
    Q5_K = 6
    Q6_K = 7
    # llama.cpp repacks Q4_K weights of a multiple of 8 rows (its CPU_REPACK buffer, q4_K_8x8 on
    # AVX2 machines) and multiplies them with other code: whole-block integer sums, no lanes
    Q4_K_X8 = 8
    Q4_K_X8_GEMM = 9   # repacked Q4_K, columns in whole fours (its gemm)
    Q6_K_TILED = 10    # the tiled K-quant matmul llama.cpp takes from 8 columns
    Q4_K_TILED = 11
    Q5_K_TILED = 12
    MXFP4 = 13         # gpt-oss's experts: E2M1 codes, an E8M0 scale per 32


VEC_DOT = {t: Act[t.vec_dot_type.name] for t in Type if t.vec_dot_type != Type.F32}
"""The activations' form for each weight type's product (the others: F32)."""

DECODER = {Type[d.name]: d for d in Dec}
"""The row decoder of each weight type that has one."""

EXACT = {Type[f.name]: f for f in Fmt if f <= Fmt.Q6_K or f == Fmt.MXFP4}
"""The weight types multiplied with ggml's exact arithmetic from their blocks."""

BATCH_FORMAT = {Fmt.Q4_K_X8: Fmt.Q4_K_X8_GEMM, Fmt.Q4_K: Fmt.Q4_K_TILED, Fmt.Q5_K: Fmt.Q5_K_TILED,
                Fmt.Q6_K: Fmt.Q6_K_TILED}
"""The format llama.cpp's kernel for a batch gives the columns of each weight kind that has one
(blockdot.column_format says which columns)."""

COLUMNWISE = frozenset(t for t, f in EXACT.items() if f not in BATCH_FORMAT)
"""The weight types whose products compute every column alike however many columns they have:
a prompt cut into pieces anywhere gives them a whole read's bits (batch_rules.COLUMNWISE_RULES)."""


def literal_kind(kind, what: str) -> int:
    """The value of a kernel's kind argument as numba types it (an ``IntegerLiteral``), for the
    functions that choose their code by kind when a kernel is compiled (numba overloads), so that
    a kernel compiles the code of one kind - the weight types a model has - not of all of them.
    The kind is a constant of the kernel (a closure's, kernel_of_kind), which numba types as a
    literal."""
    from numba.core import types
    from numba.core.errors import TypingError
    if not isinstance(kind, types.IntegerLiteral):
        raise TypingError(f"{what}: the kind must be a constant of the kernel (a literal), not {kind}")
    return kind.literal_value


def kernel_of_kind(fn, kind_name: str, **options):
    """``numba.njit(**options)(fn)`` for a kernel made for one kind (a closure over it), under a
    name of its own: numba names a function's cache index after it, and the kernels of two kinds
    compiled at once in two processes would otherwise write the one index, each dropping the
    other's entry."""
    from numba import cfunc, njit
    fn.__qualname__ = f"{fn.__qualname__.replace('.<locals>.', '_')}_{kind_name}"
    if "cfunc" in options:  # a C function of this signature (its address is called)
        return cfunc(options.pop("cfunc"), **options)(fn)
    return njit(**options)(fn)

"""Tensor element types with ggml's numbering, block sizes and type sizes.

A quantized type stores ``block_size`` consecutive elements of a row in ``type_size``
bytes; plain types have a block size of 1.  The numbering is ggml's (and GGUF's), so a
``Type`` value read from a GGUF file or sent over the wire means the same thing here.
"""
from __future__ import annotations

import enum

import numpy as np


class Type(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ4_NL = 20
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30
    MXFP4 = 39

    @property
    def block_size(self) -> int:
        return _TRAITS[self][0]

    @property
    def type_size(self) -> int:
        return _TRAITS[self][1]

    @property
    def is_quantized(self) -> bool:
        return self not in _PLAIN_DTYPES

    @property
    def has_vec_dot(self) -> bool:
        """Whether a product reads weights of this type as stored, block by block (ggml's
        type_traits_cpu vec_dot: every quantized type, and F16), rather than as float32."""
        return self.is_quantized or self == Type.F16

    @property
    def vec_dot_type(self) -> Type:
        """The form a product with weights of this type takes its activations in (ggml's
        type_traits_cpu ``vec_dot_type``): every activation row is converted to it first, and
        a MUL_MAT whose second operand is already of it takes that operand as it is."""
        return _VEC_DOT.get(self, Type.F32)

    @property
    def np_dtype(self) -> np.dtype | None:
        """numpy dtype of one element, or None for block-quantized types."""
        return _PLAIN_DTYPES.get(self)

    def row_size(self, n: int) -> int:
        """Bytes taken by ``n`` consecutive elements (n must be a multiple of the block size)."""
        if n % self.block_size:
            raise ValueError(f"{self.name}: {n} elements is not a multiple of block size {self.block_size}")
        return n // self.block_size * self.type_size


QK_K = 256  # elements per super-block of the k-quants

# type -> (block size, type size in bytes), exactly ggml's type_traits
_TRAITS: dict[Type, tuple[int, int]] = {
    Type.F32: (1, 4),
    Type.F16: (1, 2),
    Type.BF16: (1, 2),
    Type.F64: (1, 8),
    Type.I8: (1, 1),
    Type.I16: (1, 2),
    Type.I32: (1, 4),
    Type.I64: (1, 8),
    Type.Q4_0: (32, 2 + 16),
    Type.Q4_1: (32, 2 + 2 + 16),
    Type.Q5_0: (32, 2 + 4 + 16),
    Type.Q5_1: (32, 2 + 2 + 4 + 16),
    Type.Q8_0: (32, 2 + 32),
    Type.Q8_1: (32, 2 + 2 + 32),
    Type.Q2_K: (QK_K, 16 + 64 + 2 + 2),
    Type.Q3_K: (QK_K, 32 + 64 + 12 + 2),
    Type.Q4_K: (QK_K, 2 + 2 + 12 + 128),
    Type.Q5_K: (QK_K, 2 + 2 + 12 + 32 + 128),
    Type.Q6_K: (QK_K, 128 + 64 + 16 + 2),
    Type.Q8_K: (QK_K, 4 + 256 + 32),
    Type.IQ4_NL: (32, 2 + 16),
    Type.IQ4_XS: (QK_K, 2 + 2 + 4 + 128),
    Type.MXFP4: (32, 1 + 16),
}

_VEC_DOT: dict[Type, Type] = {
    Type.Q4_0: Type.Q8_0, Type.Q5_0: Type.Q8_0, Type.Q8_0: Type.Q8_0, Type.IQ4_NL: Type.Q8_0, Type.MXFP4: Type.Q8_0,
    Type.Q4_1: Type.Q8_1, Type.Q5_1: Type.Q8_1,
    Type.Q2_K: Type.Q8_K, Type.Q3_K: Type.Q8_K, Type.Q4_K: Type.Q8_K, Type.Q5_K: Type.Q8_K, Type.Q6_K: Type.Q8_K,
    Type.IQ4_XS: Type.Q8_K,
    Type.F16: Type.F16,
}

ACTIVATION_BLOCKS = (Type.Q8_0, Type.Q8_1, Type.Q8_K)
"""The vec_dot types of the quantized weights: activations a product takes as they are
(ops.mul_mat), and what a tensor split sends between devices (models/tensor_split.py)."""

_PLAIN_DTYPES: dict[Type, np.dtype] = {
    Type.F32: np.dtype(np.float32),
    Type.F16: np.dtype(np.float16),
    Type.BF16: np.dtype(np.uint16),  # raw bits; convert with quants.dequantize
    Type.F64: np.dtype(np.float64),
    Type.I8: np.dtype(np.int8),
    Type.I16: np.dtype(np.int16),
    Type.I32: np.dtype(np.int32),
    Type.I64: np.dtype(np.int64),
}


def as_type(t: object) -> Type:
    """Accept a ``Type``, a ``gguf.GGMLQuantizationType``, an int or a name like 'q4_K'."""
    if isinstance(t, Type):
        return t
    if isinstance(t, str):
        try:
            return Type[t.upper()]
        except KeyError:
            for member in Type:
                if member.name.lower() == t.lower():
                    return member
            raise ValueError(f"unknown tensor type {t!r}") from None
    try:
        return Type(int(t))  # gguf's enum is an IntEnum with the same numbers
    except ValueError:
        name = getattr(t, "name", t)
        raise ValueError(f"unsupported tensor type {name} ({int(t)})") from None

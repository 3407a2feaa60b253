"""What an op is: ggml's op numbers, and each op's parameters as one named record.

A tensor keeps its op's parameters as ggml does, in 16 int32 slots (``op_params``; floats
bit-cast), because that is what the RPC protocol sends.  Nothing outside this module reads
or writes a slot by number: :mod:`pyggml.ops` packs a record when it builds a node, and every
backend and the RPC validator unpack the same record (``RopeParams.of(node).freq_base``), so
that a slot cannot mean one thing to the CPU and another to CUDA.  The slots are ggml's, so
graphs keep meaning the same on both sides of the wire.

This module imports nothing of pyggml's: :mod:`pyggml.tensor` and :mod:`pyggml.ops` both
build on it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

MAX_OP_PARAMS = 16  # int32 slots, like GGML_MAX_OP_PARAMS / sizeof(int32_t)


class Op(enum.IntEnum):
    """ggml_op, with the numbers of ggml-rpc protocol 7.0.0 (both RPC protocols send them, and
    ``tests/test_opdefs.py`` checks them against that llama.cpp's ggml.h where it is built)."""
    NONE = 0
    DUP = 1
    ADD = 2
    ADD_ID = 3
    ADD1 = 4
    ACC = 5
    SUB = 6
    MUL = 7
    DIV = 8
    SQR = 9
    SQRT = 10
    LOG = 11
    SIN = 12
    COS = 13
    SUM = 14
    SUM_ROWS = 15
    CUMSUM = 16
    MEAN = 17
    ARGMAX = 18
    COUNT_EQUAL = 19
    REPEAT = 20
    REPEAT_BACK = 21
    CONCAT = 22
    SILU_BACK = 23
    NORM = 24
    RMS_NORM = 25
    RMS_NORM_BACK = 26
    GROUP_NORM = 27
    L2_NORM = 28
    MUL_MAT = 29
    MUL_MAT_ID = 30
    OUT_PROD = 31
    SCALE = 32
    SET = 33
    CPY = 34
    CONT = 35
    RESHAPE = 36
    VIEW = 37
    PERMUTE = 38
    TRANSPOSE = 39
    GET_ROWS = 40
    GET_ROWS_BACK = 41
    SET_ROWS = 42
    DIAG = 43
    DIAG_MASK_INF = 44
    DIAG_MASK_ZERO = 45
    SOFT_MAX = 46
    SOFT_MAX_BACK = 47
    ROPE = 48
    ROPE_BACK = 49
    CLAMP = 50
    ARGSORT = 69
    TOP_K = 70
    FLASH_ATTN_EXT = 74
    UNARY = 91
    GLU = 100


GGML_OP_COUNT = 101  # ops of ggml-rpc protocol 7.0.0 (the llama.cpp ../shared/bin/build-llamacpp builds)


class UnaryOp(enum.IntEnum):
    """ggml_unary_op; GELU is the tanh approximation, as in ggml."""
    ABS = 0
    SGN = 1
    NEG = 2
    STEP = 3
    TANH = 4
    ELU = 5
    RELU = 6
    SIGMOID = 7
    GELU = 8
    GELU_QUICK = 9
    SILU = 10
    HARDSWISH = 11
    HARDSIGMOID = 12
    EXP = 13
    EXPM1 = 14
    SOFTPLUS = 15
    GELU_ERF = 16
    GELU_TANH = 8  # alias: the name the model code uses for clarity


class GluOp(enum.IntEnum):
    REGLU = 0
    GEGLU = 1
    SWIGLU = 2
    SWIGLU_OAI = 3  # gpt-oss: min(a, limit) * sigmoid(alpha * min(a, limit)) * (clamp(b, -limit, limit) + 1)


class SortOrder(enum.IntEnum):
    ASC = 0
    DESC = 1


class RopeMode(enum.IntEnum):
    NORMAL = 0  # rotate pairs (x[2i], x[2i+1]) - llama
    NEOX = 2    # rotate pairs (x[i], x[i + n_dims/2]) - gemma, qwen


VIEW_OPS = frozenset({Op.NONE, Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE})
"""Ops that compute nothing: their result is other bytes seen another way."""


# -- parameter records ------------------------------------------------------------------------------

@dataclass(frozen=True)
class OpParams:
    """An op's parameters.  ``SLOTS`` names, per field in order, its op_params slot and whether
    it is stored as an int32 (``"i"``) or a float32's bits (``"f"``)."""
    SLOTS: ClassVar[tuple[tuple[int, str], ...]] = ()

    def pack(self, op_params: np.ndarray) -> None:
        """Write the fields into a tensor's int32 slots."""
        floats = op_params.view(np.float32)
        for name, slot, kind in _layout(type(self)):
            value = getattr(self, name)
            if kind == "f":
                floats[slot] = value
            else:
                op_params[slot] = int(value)

    @classmethod
    def unpack(cls, op_params: np.ndarray):
        """The record stored in int32 slots (an enum field of an unknown value: ValueError).
        Kernels call this for every op they run, and a model has a handful of distinct
        parameter sets: records are kept by their slots' bytes."""
        key = (cls, op_params.tobytes())
        record = _RECORDS.get(key)
        if record is None:
            ints, floats = op_params.tolist(), op_params.view(np.float32).tolist()
            values = [floats[slot] if kind == "f" else _FIELD_TYPES.get(f.type, int)(ints[slot])
                      for f, (slot, kind) in zip(dataclasses.fields(cls), cls.SLOTS)]
            if len(_RECORDS) >= 4096:  # bounded, whatever graphs come (an RPC server's clients')
                _RECORDS.clear()
            record = _RECORDS[key] = cls(*values)
        return record

    @classmethod
    def of(cls, node):
        """The record of a node's op (a :class:`pyggml.tensor.Tensor`)."""
        return cls.unpack(node.op_params)

    def values(self) -> tuple:
        return dataclasses.astuple(self)


@functools.cache
def _layout(cls: type) -> tuple[tuple[str, int, str], ...]:
    """A record class's fields with their slots and kinds (a graph packs hundreds of records:
    dataclasses.fields() is not free)."""
    return tuple((f.name, slot, kind) for f, (slot, kind) in zip(dataclasses.fields(cls), cls.SLOTS))


# field annotations (strings, with postponed evaluation) that unpack turns into enums
_FIELD_TYPES = {"UnaryOp": UnaryOp, "GluOp": GluOp, "SortOrder": SortOrder, "bool": bool}
_RECORDS: dict[tuple, OpParams] = {}  # (record class, slot bytes) -> record (frozen: safe to share)


@dataclass(frozen=True)
class ScaleParams(OpParams):
    """SCALE: a * scale + bias."""
    scale: float
    bias: float = 0.0
    SLOTS = ((0, "f"), (1, "f"))


@dataclass(frozen=True)
class UnaryParams(OpParams):
    op: UnaryOp
    SLOTS = ((0, "i"),)


@dataclass(frozen=True)
class GluParams(OpParams):
    """GLU: act(a) * b, or act(b) * a when ``swapped``; SWIGLU_OAI's ``alpha`` and ``limit``."""
    op: GluOp
    swapped: bool = False
    alpha: float = 0.0
    limit: float = 0.0
    SLOTS = ((0, "i"), (1, "i"), (2, "f"), (3, "f"))


@dataclass(frozen=True)
class NormParams(OpParams):
    """NORM and RMS_NORM."""
    eps: float
    SLOTS = ((0, "f"),)


@dataclass(frozen=True)
class SoftMaxParams(OpParams):
    scale: float = 1.0
    max_bias: float = 0.0
    SLOTS = ((0, "f"), (1, "f"))


@dataclass(frozen=True)
class RopeParams(OpParams):
    """ROPE, in ggml's slots (0 and 3 unused: ggml's former n_past and n_ctx)."""
    n_dims: int
    mode: int = RopeMode.NORMAL
    n_ctx_orig: int = 0
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    SLOTS = ((1, "i"), (2, "i"), (4, "i"), (5, "f"), (6, "f"), (7, "f"), (8, "f"), (9, "f"), (10, "f"))


@dataclass(frozen=True)
class PermuteParams(OpParams):
    """PERMUTE (and TRANSPOSE): source dim i becomes result dim axes[i]."""
    ax0: int
    ax1: int
    ax2: int
    ax3: int
    SLOTS = ((0, "i"), (1, "i"), (2, "i"), (3, "i"))


@dataclass(frozen=True)
class ConcatParams(OpParams):
    dim: int
    SLOTS = ((0, "i"),)


@dataclass(frozen=True)
class ClampParams(OpParams):
    min: float
    max: float
    SLOTS = ((0, "f"), (1, "f"))


@dataclass(frozen=True)
class ArgsortParams(OpParams):
    order: SortOrder
    SLOTS = ((0, "i"),)


@dataclass(frozen=True)
class FlashAttnParams(OpParams):
    scale: float
    max_bias: float = 0.0
    logit_softcap: float = 0.0
    SLOTS = ((0, "f"), (1, "f"), (2, "f"))


PARAMS: dict[Op, type[OpParams]] = {
    Op.ARGSORT: ArgsortParams,
    Op.CLAMP: ClampParams,
    Op.SCALE: ScaleParams,
    Op.UNARY: UnaryParams,
    Op.GLU: GluParams,
    Op.NORM: NormParams,
    Op.RMS_NORM: NormParams,
    Op.SOFT_MAX: SoftMaxParams,
    Op.ROPE: RopeParams,
    Op.PERMUTE: PermuteParams,
    Op.TRANSPOSE: PermuteParams,
    Op.CONCAT: ConcatParams,
    Op.FLASH_ATTN_EXT: FlashAttnParams,
}
"""The record of every op that has parameters; the others leave op_params at zero."""

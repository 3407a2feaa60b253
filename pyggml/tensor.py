"""The tensor: ggml's ``struct ggml_tensor`` as a Python object.

A tensor describes data (type, ``ne`` element counts with ``ne[0]`` innermost, ``nb`` byte
strides) and, when it is the result of an op, how to compute it (``op``, ``op_params``,
``src``).  Views share their ``view_src``'s bytes at ``view_offs``.  Where the bytes live is
``buffer`` + ``offset``; building a tensor never allocates or computes anything.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .opdefs import MAX_OP_PARAMS, Op
from .types import Type, as_type

if TYPE_CHECKING:
    from .backend import Buffer

MAX_DIMS = 4
MAX_SRC = 10


class TensorFlag(enum.IntFlag):
    INPUT = 1
    OUTPUT = 2
    PARAM = 4


NO_FLAGS = TensorFlag(0)


class Tensor:
    __slots__ = ("type", "ne", "nb", "op", "op_params", "src", "view_src", "view_offs",
                 "buffer", "offset", "name", "flags", "__weakref__")

    def __init__(self, type: Type, ne: Sequence[int], nb: Sequence[int] | None = None, *,
                 op: "int" = 0, src: Sequence[Tensor | None] = (), view_src: Tensor | None = None,
                 view_offs: int = 0, name: str = "") -> None:
        self.type = type if type.__class__ is Type else as_type(type)
        ne = tuple(map(int, ne)) + (1,) * (MAX_DIMS - len(ne))
        if len(ne) != MAX_DIMS or min(ne) < 0:
            raise ValueError(f"invalid tensor shape {ne}")
        if ne[0] % self.type.block_size:
            raise ValueError(f"{self.type.name} tensor: ne[0]={ne[0]} is not a multiple of the "
                             f"block size {self.type.block_size}")
        self.ne: tuple[int, int, int, int] = ne  # type: ignore[assignment]
        self.nb: tuple[int, int, int, int] = tuple(nb) if nb is not None else contiguous_strides(self.type, ne)  # type: ignore[assignment]
        # (a model's graph makes hundreds of tensors for every new batch shape: no enum
        # construction where the value already is one)
        self.op = op if op.__class__ is Op else Op(op)
        self.op_params = np.zeros(MAX_OP_PARAMS, dtype=np.int32)
        self.src: list[Tensor | None] = list(src)
        self.view_src = view_src
        self.view_offs = int(view_offs)
        self.buffer: Buffer | None = None
        self.offset = 0
        self.name = name
        self.flags = NO_FLAGS
        if view_src is not None:  # a view of allocated data is allocated too
            root = view_src
            self.view_src = root
            if root.buffer is not None:
                self.buffer = root.buffer
                self.offset = root.offset + self.view_offs

    # -- shape helpers (ggml_nelements, ggml_nbytes, ggml_is_contiguous ...) -------------
    @property
    def n_dims(self) -> int:
        for i in range(MAX_DIMS - 1, 0, -1):
            if self.ne[i] != 1:
                return i + 1
        return 1

    def nelements(self) -> int:
        n0, n1, n2, n3 = self.ne
        return n0 * n1 * n2 * n3

    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    def nbytes(self) -> int:
        """Bytes spanned from the first to one past the last element, whatever the strides
        (ggml_nbytes): one element plus every stride walked to the last, or for a block type
        the first row's blocks plus the other strides."""
        if 0 in self.ne:
            return 0
        if self.type.block_size == 1:
            size = self.type.type_size + (self.ne[0] - 1) * self.nb[0]
        else:
            size = self.ne[0] // self.type.block_size * self.nb[0]  # ne[0] counts elements, nb[0] a block
        for i in range(1, MAX_DIMS):
            size += (self.ne[i] - 1) * self.nb[i]
        return size

    def row_size(self) -> int:
        return self.type.row_size(self.ne[0])

    def is_contiguous(self) -> bool:
        """Rows packed without gaps; strides of dimensions of size 1 do not matter."""
        ne, nb = self.ne, self.nb
        size = self.type.type_size
        if nb[0] != size:
            return False
        want = size * (ne[0] // self.type.block_size)  # contiguous_strides, dimension by dimension
        for i in range(1, MAX_DIMS):
            if ne[i] != 1 and nb[i] != want:
                return False
            want *= ne[i]
        return True

    def is_view(self) -> bool:
        return self.view_src is not None

    def set_name(self, name: str) -> Tensor:
        self.name = name
        return self

    def set_input(self) -> Tensor:
        self.flags |= TensorFlag.INPUT
        return self

    def set_output(self) -> Tensor:
        self.flags |= TensorFlag.OUTPUT
        return self

    def data_root(self) -> Tensor:
        """The tensor that owns this tensor's bytes (itself unless it is a view)."""
        return self.view_src if self.view_src is not None else self

    def __repr__(self) -> str:
        shape = "x".join(str(n) for n in self.ne[:self.n_dims])
        return f"Tensor({self.name or '?'}: {self.type.name}[{shape}] op={self.op.name})"


def contiguous_strides(type: Type, ne: Sequence[int]) -> tuple[int, int, int, int]:
    nb0 = type.type_size
    nb1 = nb0 * (ne[0] // type.block_size)
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


def new_tensor(type: object, ne: Sequence[int], name: str = "") -> Tensor:
    """A fresh leaf tensor (no op); give it data by allocating it in a buffer."""
    return Tensor(as_type(type), ne, name=name)


def same_shape(a: Tensor, b: Tensor) -> bool:
    return a.ne == b.ne


def can_repeat(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` broadcasts to ``b`` (each of b's dims a multiple of a's)."""
    return all(x != 0 and y % x == 0 for x, y in zip(a.ne, b.ne))

"""The CPU's kernels as *parts* that warmup.py compiles ahead, each registered beside its kernel.

A part is a name another process can compile (into numba's cache), a function that compiles
it by making or running the kernel's calls on small arrays, and a rough cost in seconds on the
2-core machine the project is developed on (the compiling processes take the costliest first:
the closer these are, the closer they finish together).  Three groups:

- the layers' parts, which every model compiles (``norms``, ``attention`` ...);
- the gates, named as their ops are (``swiglu``: Architecture.gate_name): a model compiles
  its feed-forward's only;
- the others, which a model's weights ask for (warmup.parts_for_tensors), among them parts of
  a kind, one for each member of an enum: ``product:Q4_1`` is a weight format's product rows.
"""
from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np

from ..types import Type

LAYERS: dict[str, tuple[Callable[[], None], float]] = {}
GATES: dict[str, tuple[Callable[[], None], float]] = {}
OTHERS: dict[str, tuple[Callable[[], None], float]] = {}
KINDS: dict[str, tuple[type[enum.IntEnum], Callable[[enum.IntEnum], None], Callable[[enum.IntEnum], float]]] = {}

K = 256  # a row length every format's block divides


def part(name: str, cost: float, group: dict = OTHERS) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register the decorated function as part ``name`` of ``group`` (LAYERS, GATES or OTHERS)."""
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        group[name] = (fn, cost)
        return fn
    return register


def kind_part(name: str, kinds: type[enum.IntEnum], cost: Callable[[enum.IntEnum], float]):
    """Register the decorated function of one member of ``kinds`` as the parts ``name:MEMBER``."""
    def register(fn: Callable[[enum.IntEnum], None]) -> Callable[[enum.IntEnum], None]:
        KINDS[name] = (kinds, fn, cost)
        return fn
    return register


def sample_x(n: int) -> np.ndarray:
    """n rows of K float32 values, for a part's calls."""
    return np.linspace(-1, 1, n * K, dtype=np.float32).reshape(n, K)


def sample_weights(qtype: Type, rows: int, experts: int = 0) -> np.ndarray:
    """Zero weight rows as they reach the kernels: uint8, read-only (qmatmul.frozen)."""
    from .qmatmul import frozen
    shape = (experts, rows, qtype.row_size(K)) if experts else (rows, qtype.row_size(K))
    return frozen(np.zeros(shape, dtype=np.uint8))

"""Row kernels as C functions, and the one parallel loop that runs them all.

numba compiles a parallel loop's body into a kernel of its own and copies into it - and
optimizes and compiles again - every function the body calls; a kernel that also takes a single
row without the threads holds the row's code twice more.  Seconds of the wait for a new
machine's first answer went to those copies (warmup.py).  So a row kernel here is a C function
(numba.cfunc) over a range of rows, compiled once, and :func:`run_table` is the one parallel loop
of every one of them: it calls a kernel by its address for a chunk of rows per thread, or once
in the calling thread for a single row (less than waking the threads).

Every row kernel has the one signature ROW_KERNEL: ``(start, end, i0 .. i9, f0, f1)`` - the
rows start..end, ten integers (addresses of C-contiguous arrays, sizes, flags; zeros where a
kernel takes fewer) and two floats as doubles (a float32 passes exactly).  A kernel names them
by its parameters, and its argument record (:func:`row_args`) is made from those names, so
that a call says what it passes by name.  A product's rows (qdot.py) take sixteen integers,
start and end among them.  A kernel views its arrays with
numba.carray, sized by ``end``: the rows it touches are there.  The kernel's address is this
process's (a compiled function is cached on disk, an address is not).

A kernel's call is data: a :class:`RowCall` (its address, its rows, how they are cut into
chunks, its arguments), made in Python by each kernel's ``*_call`` function, which checks the
arrays it will read - their type, layout and shapes - once.  :func:`run_table`, one compiled
function, runs a whole table of calls in order: a graph plan's steps are such calls, and a
plan runs most of a decoding step as one table (plan.py) instead of a Python call per kernel,
which cost as much as a decoding step's small kernels themselves.  Calling a kernel once is a
table of one call (:func:`run_calls`).  A table holds addresses only: whoever holds it holds
the arrays.
"""
from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numba
import numpy as np
from numba import carray, cfunc, njit, prange, types

from .kinds import kernel_of_kind
from .parts import LAYERS, part
from .simd import KERNEL, call_address, pointer

INTS = 10
# chunks of rows a parallel loop makes: a constant, not numba.get_num_threads() (which numba
# cannot keep in its cache); many, so that each thread's share is close to even
CHUNKS = 64
ROW_KERNEL = types.void(types.intp, types.intp, *[types.intp] * INTS, types.float64, types.float64)


def row_kernel(fn: Callable[..., None], kind_name: str | None = None) -> int:
    """The address of ``fn`` (a Python function of ROW_KERNEL's parameters) compiled as a C
    function; ``kind_name``: of the kind ``fn`` is made for (kinds.kernel_of_kind)."""
    # numba starts its threads when a parallel function is called from Python or compiled, not
    # when compiled code loaded from its cache runs a parallel loop: start them here (every
    # call is made with a kernel's address first)
    numba.get_num_threads()
    if kind_name is not None:
        return kernel_of_kind(fn, kind_name, cfunc=ROW_KERNEL, **KERNEL).address
    return cfunc(ROW_KERNEL, **KERNEL)(fn).address


# a RowCall's form: how its C function takes its arguments
ROWS = 0     # ROW_KERNEL: (start, end, INTS integers, two floats)
PRODUCT = 1  # a product's rows (qdot.product_kernel): PRODUCT_INTS integers, start and end the 4th and 5th
PRODUCT_BY_SLOT = 2  # PRODUCT, its address the address of an int64 that holds the function's when the call runs
PRODUCT_INTS = 16


class RowCall(NamedTuple):
    """One call of a row kernel: the C function at ``at`` over rows 0..n_rows, in ``n_chunks``
    chunks of ``per`` rows on the threads, or in one call in the calling thread (n_chunks 1);
    ``ints``: its PRODUCT_INTS integer arguments (the first INTS for ROWS; zeros past those a
    kernel takes, and where a product's start and end go), ``floats``: two floats (ROWS only)."""
    form: int
    at: int
    n_rows: int
    n_chunks: int
    per: int
    ints: tuple
    floats: tuple = (0.0, 0.0)


def chunking(n_rows: int) -> tuple[int, int]:
    """How rows_call cuts n_rows: (chunks, rows per chunk) - at most CHUNKS chunks, a single
    row in the calling thread."""
    n_chunks = min(n_rows, CHUNKS) if n_rows > 1 else 1
    return n_chunks, (n_rows + n_chunks - 1) // n_chunks if n_rows else 0


_UNUSED = re.compile(r"[if]\d+")  # a kernel's name for a slot of ROW_KERNEL it does not read


def row_args(kernel: Callable[..., None]) -> type:
    """The argument record of a row kernel: a NamedTuple of the kernel's own parameters after
    ``start`` and ``end`` (its names: ``i3``/``f1`` are slots it does not read, left out), each
    0 unless given.  So a kernel's arguments are declared once, by its signature, and a call
    names what it passes: ``NormArgs(summed_at=x_at, normed_at=out_at, n=n, eps=eps)``.  A
    kernel views the arrays it is given only where its flags say it reads them, so an address
    left 0 is never read."""
    params = list(inspect.signature(kernel).parameters)[2:]
    if len(params) != INTS + 2:
        raise TypeError(f"{kernel.__name__}: a row kernel takes start, end, {INTS} integers and 2 floats")
    named = [(p, float if i >= INTS else int) for i, p in enumerate(params) if not _UNUSED.fullmatch(p)]
    where = [next((j for j, (n, _) in enumerate(named) if n == p), -1) for p in params]
    base = NamedTuple(f"{kernel.__name__.strip('_')}_args", named)
    base.__new__.__defaults__ = tuple(t() for _, t in named)

    class Args(base):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def packed(self) -> tuple[tuple, tuple]:
            """(PRODUCT_INTS integers, two floats): ROW_KERNEL's arguments after start and end."""
            values = [self[j] if j >= 0 else 0 for j in where]
            return _ints(values[:INTS], INTS), (float(values[INTS]), float(values[INTS + 1]))
    Args.__name__ = Args.__qualname__ = base.__name__
    return Args


def rows_call(at: int, n_rows: int, args: tuple) -> RowCall:
    """The call of the row kernel at ``at`` over n_rows rows, cut as chunking() says, with its
    argument record ``args`` (row_args)."""
    n_chunks, per = chunking(n_rows)
    return RowCall(ROWS, at, n_rows, n_chunks, per, *args.packed())


def serial_call(at: int, n_rows: int, args: tuple) -> RowCall:
    """The row kernel at ``at`` over all n_rows in one call in the calling thread (for a few
    rows: less than waking the others)."""
    return RowCall(ROWS, at, n_rows, 1, n_rows, *args.packed())


def product_call(at: int, n_rows: int, n_chunks: int, per: int, ints: Sequence[int], by_slot: bool = False) -> RowCall:
    """A product's rows (PRODUCT form) in n_chunks chunks of ``per`` rows; ``by_slot``: ``at`` is
    the address of a slot (int64) holding the function's address (qdot's deferred tiles)."""
    return RowCall(PRODUCT_BY_SLOT if by_slot else PRODUCT, at, n_rows, n_chunks, per, _ints(ints, PRODUCT_INTS))


def address_of(a: np.ndarray) -> int:
    """The address of an array's first element (a row kernel's argument)."""
    return a.__array_interface__["data"][0]


def c_rows(dtype: type, *arrays: np.ndarray) -> bool:
    """Whether every array is C-contiguous of ``dtype``: what a row kernel may view with
    numba.carray."""
    return all(a.dtype == dtype and a.flags.c_contiguous for a in arrays)


def _ints(ints: Sequence[int], n: int) -> tuple:
    """``ints`` as PRODUCT_INTS Python ints (a table's row: zeros past the n a kernel takes)."""
    if len(ints) > n:
        raise ValueError(f"a row kernel takes at most {n} integers, not {len(ints)}")
    return tuple(map(int, ints)) + _ZEROS[len(ints)]


_ZEROS = [(0,) * (PRODUCT_INTS - i) for i in range(PRODUCT_INTS + 1)]


TABLES_RUNNING = threading.Lock()  # one table at a time, as the GIL kept them before run_table released it


class Table:
    """RowCalls as the arrays run_table reads; calling it runs them in order."""
    __slots__ = ("heads", "ints", "floats")

    def __init__(self, calls: Sequence[RowCall]) -> None:
        n = len(calls)
        self.heads = np.array([c[:5] for c in calls], dtype=np.int64).reshape(n, 5)
        self.ints = np.array([c.ints for c in calls], dtype=np.int64).reshape(n, PRODUCT_INTS)
        self.floats = np.array([c.floats for c in calls], dtype=np.float64).reshape(n, 2)

    def __call__(self) -> None:
        with TABLES_RUNNING:  # (numba's workqueue layer aborts on parallel kernels run at once)
            run_table(self.heads, self.ints, self.floats)


def run_calls(calls: Sequence[RowCall]) -> None:
    """The calls, in order, now (a table made and dropped)."""
    Table(calls)()


@njit(inline="always", **KERNEL)
def _call(heads, ints, floats, e, start, end):
    """Entry e of a table over rows start..end, as its form takes its arguments."""
    at = heads[e, 1]
    if heads[e, 0] == PRODUCT_BY_SLOT:
        at = carray(pointer(at, np.int64), (1,))[0]
    if heads[e, 0] == ROWS:
        call_address(at, (start, end, ints[e, 0], ints[e, 1], ints[e, 2], ints[e, 3], ints[e, 4], ints[e, 5],
                                   ints[e, 6], ints[e, 7], ints[e, 8], ints[e, 9], floats[e, 0], floats[e, 1]))
    else:
        call_address(at, (ints[e, 0], ints[e, 1], ints[e, 2], start, end, ints[e, 5], ints[e, 6], ints[e, 7],
                                   ints[e, 8], ints[e, 9], ints[e, 10], ints[e, 11], ints[e, 12], ints[e, 13],
                                   ints[e, 14], ints[e, 15]))


@njit(parallel=True, nogil=True, **KERNEL)
def run_table(heads, ints, floats):
    """Every call of a table (Table's arrays: heads [n, 5] of form, address, rows, chunks and rows
    per chunk; ints [n, PRODUCT_INTS]; floats [n, 2]) in order, each over its chunks on the
    threads, or in this thread for a single chunk.  It runs without the GIL: while a step
    computes, the server's event loop streams text and a graph can be built beside it."""
    for e in range(heads.shape[0]):
        n_rows, n_chunks, per = heads[e, 2], heads[e, 3], heads[e, 4]
        if n_chunks <= 1:
            if n_rows > 0:
                _call(heads, ints, floats, e, 0, n_rows)
            continue
        for c in prange(n_chunks):
            _call(heads, ints, floats, e, c * per, min(n_rows, (c + 1) * per))


@part("table", 1.2, LAYERS)
def _compile_table() -> None:
    """run_table, which runs every row kernel's calls: a table of none."""
    run_calls([])

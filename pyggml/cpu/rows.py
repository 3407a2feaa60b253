"""Row kernels as C functions, and the one parallel loop that runs them all.

numba compiles a parallel loop's body into a kernel of its own and copies into it - and
optimizes and compiles again - every function the body calls; a kernel that also takes a single
row without the threads holds the row's code twice more.  Seconds of the wait for a new
machine's first answer went to those copies (warmup.py).  So a row kernel here is a C function
(numba.cfunc) over a range of rows, compiled once, and :func:`run_rows` is the parallel loop of
every one of them: it calls a kernel by its address for a chunk of rows per thread, or once in
the calling thread for a single row (less than waking the threads).

Every row kernel has the one signature ROW_KERNEL, so that ``run_rows`` is compiled once for
all: ``(start, end, i0 .. i9, f0, f1)`` - the rows start..end, ten integers (addresses of
C-contiguous arrays, sizes, flags; zeros where a kernel takes fewer) and two floats as doubles
(a float32 passes exactly).  A kernel views its arrays with numba.carray, sized by ``end``:
the rows it touches are there.  Each kernel's entry point is an njit function that
checks its arrays and calls ``run_rows`` with the addresses (simd.address); the kernel's own
address comes from Python at every call (a compiled function is cached on disk, an address
is this process's).  An array an entry point makes itself must outlive the kernel's run:
:func:`keep` it.
"""
from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
from numba import cfunc, njit, prange, types

from .kinds import kernel_of_kind
from .simd import KERNEL, call_address

INTS = 10
# chunks of rows a parallel loop makes: a constant, not numba.get_num_threads() (which numba
# cannot keep in its cache); many, so that each thread's share is close to even
CHUNKS = 64
UNUSED = np.intp(0)  # an integer a kernel does not take (not the constant 0: numba would type each
                     # tuple with its own literals, and compile run_rows once per kernel)
ROW_KERNEL = types.void(types.intp, types.intp, *[types.intp] * INTS, types.float64, types.float64)


@njit(**KERNEL)
def keep(arrays):
    """Nothing, but a use of ``arrays`` (a tuple): called after run_rows, so that numba frees an
    array its caller made, whose address a kernel read, after the kernel ran - numba frees a
    value after its last use, and taking its address is not one that lasts.  A call, not
    inlined: numba would drop an inlined use that computes nothing."""
    return None


def row_kernel(fn: Callable[..., None], kind_name: str | None = None) -> int:
    """The address of ``fn`` (a Python function of ROW_KERNEL's parameters) compiled as a C
    function; ``kind_name``: of the kind ``fn`` is made for (kinds.kernel_of_kind)."""
    # numba starts its threads when a parallel function is called from Python or compiled, not
    # when an entry point loaded from its cache runs run_rows's parallel code: start them here
    # (every entry point takes a kernel's address first)
    numba.get_num_threads()
    if kind_name is not None:
        return kernel_of_kind(fn, kind_name, cfunc=ROW_KERNEL, **KERNEL).address
    return cfunc(ROW_KERNEL, **KERNEL)(fn).address


@njit(parallel=True, **KERNEL)
def run_rows(at, n_rows, ints, floats):
    """The kernel at ``at`` over rows 0..n_rows in at most CHUNKS chunks (numba gives each thread
    a contiguous range of them), or in one call in this thread for a single row (none for
    none).  ``ints``: INTS integers, ``floats``: two floats."""
    if n_rows <= 1:
        if n_rows == 1:
            call_address(at, (0, 1) + ints + floats)
        return
    n_chunks = min(n_rows, CHUNKS)
    per = (n_rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        call_address(at, (c * per, min(n_rows, (c + 1) * per)) + ints + floats)

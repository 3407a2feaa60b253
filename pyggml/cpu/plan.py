"""A CPU graph plan's steps run as tables: most of a decoding step in one compiled call.

A binder (ops/) that can say what its node's kernels are as row-kernel calls
(rows.RowCall: an address, rows, arguments resolved when the plan is made) returns a
:class:`TableStep`.  The plan joins consecutive table steps into one :class:`TableRun`: one
call of rows.run_table for all their kernels, instead of a Python call (and numba's checks of
every argument) per kernel - which cost a decoding step about as much as its small kernels.
Steps that cannot be tables (a kernel numpy runs, an op whose arrays change from step to step)
run between the tables as Python functions, as before.

What a kernel's call needs that changes from step to step and comes from the graph's inputs
(the positions' RoPE angles, the cells a mask shows, the checked row ids of the cache writes)
is computed in Python by the step's ``prepare``, into arrays the calls read by address.  A
table runs the prepares of all its steps first: a graph's inputs are set before it runs, so
this is the same as running each before its step - unless an earlier step of the same table
writes what a prepare reads; the plan then starts a new table there (``reads``).

What the kernels find wrong in data the step itself computed (an expert id outside the
weights: experts.py) cannot raise inside the table: the kernel notes it and reads nothing out of
bounds, and the step's ``check`` raises once the table has run.

Run alone (op by op, or timed by OpProfile), a table step runs its prepare and its own calls:
the same kernels on the same arrays, so a plan gives the bits of the op-by-op path.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..tensor import Tensor
from .buffer import CPUBuffer
from .rows import RowCall, Table

Span = tuple[int, int, int]  # a buffer's id, and the first and past-the-last bytes


def span(t: Tensor) -> Span | None:
    """The bytes a tensor's view may touch (None where it is not in host memory)."""
    buffer = t.buffer
    if not isinstance(buffer, CPUBuffer):
        return None
    (ne0, ne1, ne2, ne3), (nb0, nb1, nb2, nb3), start = t.ne, t.nb, t.offset
    if not (ne0 and ne1 and ne2 and ne3):
        return id(buffer), start, start
    size = t.type.type_size
    row = ne0 // t.type.block_size * size if nb0 == size else (ne0 - 1) * nb0 + size
    return id(buffer), start, start + row + (ne1 - 1) * nb1 + (ne2 - 1) * nb2 + (ne3 - 1) * nb3


def overlap(a: Span | None, b: Span | None) -> bool:
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class TableStep:
    """A step as row-kernel calls.  ``make_calls`` gives them (called once, when the plan's
    tables are made or at the step's first run: every step of the plan is bound by then, and
    scratch shared between steps is sized); ``prepare``: Python run before them at every run;
    ``reads``: the tensors ``prepare`` reads; ``hold``: arrays the calls read that nothing
    else holds; ``check``: Python run after the calls (raises for what they found wrong)."""
    __slots__ = ("make_calls", "_calls", "prepare", "reads", "hold", "check", "_table")

    def __init__(self, make_calls: Callable[[], Sequence[RowCall]], prepare: Callable[[], None] | None = None,
                 reads: Sequence[Tensor] = (), hold: tuple = (), check: Callable[[], None] | None = None) -> None:
        self.make_calls, self._calls, self.prepare, self.reads, self.hold = make_calls, None, prepare, reads, hold
        self.check = check
        self._table = None

    @property
    def calls(self) -> Sequence[RowCall]:
        if self._calls is None:
            self._calls = list(self.make_calls())
        return self._calls

    def __call__(self) -> None:
        if self.prepare is not None:
            self.prepare()
        if self._table is None:
            self._table = Table(self.calls)
        self._table()
        if self.check is not None:
            self.check()


class TableRun:
    """Consecutive table steps of a plan: every prepare, then one table of all their calls,
    then every check."""
    __slots__ = ("steps", "prepares", "checks", "_table")

    def __init__(self, steps: list[TableStep]) -> None:
        self.steps = steps
        self.prepares = [s.prepare for s in steps if s.prepare is not None]
        self.checks = [s.check for s in steps if s.check is not None]
        # made with the plan (every step is bound by now), so that its first run is as quick as the next
        self._table = Table([call for step in self.steps for call in step.calls])

    def __call__(self) -> None:
        for prepare in self.prepares:
            prepare()
        self._table()
        for check in self.checks:
            check()


def plan_runs(steps: Sequence[Callable[[], None]], outputs: Sequence[Sequence[Tensor]]) -> list[Callable[[], None]]:
    """What a plan calls at each compute: its steps, consecutive table steps joined into
    TableRuns.  ``outputs``: the nodes each step computes (a step whose prepare reads what an
    earlier one of the run writes starts a new run)."""
    runs: list[Callable[[], None]] = []
    current: list[TableStep] = []
    written: list[Span | None] = []
    for step, outs in zip(steps, outputs):
        if not isinstance(step, TableStep):
            if current:
                runs.append(TableRun(current))
                current, written = [], []
            runs.append(step)
            continue
        reads = [span(t) for t in step.reads]
        if current and any(overlap(r, w) for r in reads for w in written):
            runs.append(TableRun(current))
            current, written = [], []
        current.append(step)
        written.extend(span(t) for t in outs)
    if current:
        runs.append(TableRun(current))
    return runs


class ArrayPool:
    """Arrays for values that pass between the steps of a plan (a product's quantized
    activations, read by every product of one input): each lives from the first step that uses
    it to the last, and one whose steps are all done is used again by a later value of the same
    shapes - a prompt's plan would otherwise hold every layer's.  The steps ask while they are
    bound (``use``, in the order they run) and get their arrays when every step is bound."""

    def __init__(self) -> None:
        self._uses: dict[object, list] = {}  # key: [specs, first use, last use]
        self._clock = 0
        self._made: dict[object, tuple] | None = None

    def use(self, key: object, specs: tuple[tuple[tuple[int, ...], type], ...]) -> Callable[[], tuple]:
        """The arrays of ``key`` (shape and dtype of each: ``specs``) for the step being bound,
        as a function to call once every step is."""
        if self._made is not None:
            raise RuntimeError("ArrayPool: a use after the arrays were made")
        self._clock += 1
        if key in self._uses:
            if self._uses[key][0] != specs:
                raise ValueError(f"ArrayPool: {key!r} asked for with other shapes")
            self._uses[key][2] = self._clock
        else:
            self._uses[key] = [specs, self._clock, self._clock]
        return lambda: self._arrays(key)

    def _arrays(self, key: object) -> tuple:
        if self._made is None:
            self._made = self._assign()
        return self._made[key]

    def _assign(self) -> dict[object, tuple]:
        made: dict[object, tuple] = {}
        free: dict[tuple, list[tuple]] = {}
        live: list[tuple[int, tuple, tuple]] = []  # (last use, specs, arrays)
        for key, (specs, first, last) in sorted(self._uses.items(), key=lambda item: item[1][1]):
            for done in [x for x in live if x[0] < first]:
                live.remove(done)
                free.setdefault(done[1], []).append(done[2])
            spare = free.get(specs)
            arrays = spare.pop() if spare else tuple(np.empty(shape, dtype=dtype) for shape, dtype in specs)
            made[key] = arrays
            live.append((last, specs, arrays))
        return made

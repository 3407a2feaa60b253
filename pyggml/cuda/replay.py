"""Replaying a graph's kernel launches, and capturing them as a CUDA graph.

A decode step computes the same graph, on the same allocation, for many tokens in a row
(models/context.py, until the cells the attention reads grow): only the bytes of its inputs change.  When every op of the graph is a
kernel launch (pyggml/cuda/kernels.py), the launches' arguments - pointers, sizes, constants -
are the same each time, so the op table's Python (views, shapes, argument lists) need not
run again:

1. the second time a graph runs, its launches are recorded (``LaunchList``);
2. the third time, they are captured into a CUDA graph on a capturing stream
   (``cupy.cuda.Stream.begin_capture``); from then on one ``Graph.launch`` runs the whole
   step, and the host's cost per token no longer grows with the number of ops;
3. where capture fails (an old driver, a CuPy without it), the recorded launches are
   replayed one by one instead: CuPy's launch is all the Python left per op.

An op that does anything but launch our kernels (a CuPy expression, a copy, cuBLAS) calls
``eager()``, and its graph always runs through the op table.  Temporaries the ops allocate
(activations quantized to q8_1, attention probabilities) are referenced by the recorded
arguments, so they stay allocated - and are reused by every replay - while the graph lives.
``PYGGML_CUDA_GRAPHS=0`` stops at step 1's replay; ``PYGGML_CUDA_REPLAY=0`` turns both off.
"""
from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

RECORD_ON_RUN = 2  # the first run may be of a graph that never comes back (a prompt): nothing is kept


class LaunchList:
    """Kernel launches in order: (raw kernel, grid, block, args)."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.replayable = True

    def run(self) -> None:
        for kernel, grid, block, args in self.launches:
            kernel(grid, block, args)

    def __len__(self) -> int:
        return len(self.launches)


class _Recording(threading.local):
    launches: LaunchList | None = None  # being recorded in this thread (two models may run in two)


_state = _Recording()


class Kernel:
    """A compiled kernel (``cupy.RawKernel``): launching it also appends the launch to the list
    being recorded, if any."""

    __slots__ = ("raw",)

    def __init__(self, raw) -> None:
        self.raw = raw

    def __call__(self, grid, block, args) -> None:
        self.raw(grid, block, args)
        recording = _state.launches
        if recording is not None:
            recording.launches.append((self.raw, grid, block, args))


def eager() -> None:
    """The op running now does more than launch kernels: its graph cannot be replayed."""
    if _state.launches is not None:
        _state.launches.replayable = False


@contextmanager
def recording(on: bool):
    """Record the launches made inside this thread (yields the LaunchList; None when not on)."""
    if not on:
        yield None
        return
    _state.launches = LaunchList()
    try:
        yield _state.launches
    finally:
        _state.launches = None


def enabled(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def capture(launches: LaunchList):
    """The launches as a CUDA graph (cupy.cuda.Graph), captured on a stream of their own; its
    launches are not run now."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            launches.run()
        finally:
            graph = stream.end_capture()
    return graph


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass
class Replay:
    """What a graph's runs recorded: how often it ran, its launches once recorded, the CUDA graph
    captured from them (False when capture failed), and whether it can never be replayed."""
    runs: int = 0
    launches: LaunchList | None = None
    captured: object = None
    eager: bool = False


def compute(state: Replay, run_ops: Callable[[], None]) -> None:
    """Run one graph's ops: through ``run_ops`` (the op table), or from what its earlier runs
    recorded in ``state``."""
    state.runs += 1
    plan = state.launches if enabled("PYGGML_CUDA_REPLAY") else None
    if plan is not None:
        if enabled("PYGGML_CUDA_GRAPHS"):
            if state.captured is None:  # the first run after the recording: capture it
                try:
                    state.captured = capture(plan)
                except Exception as e:  # noqa: BLE001 - whatever failed, the launches can still run one by one
                    _warn_once(f"CUDA graph capture failed ({type(e).__name__}: {e}); decode steps replay "
                               "their kernel launches one by one instead")
                    state.captured = False
            if state.captured:
                state.captured.launch()
                return
        plan.run()
        return
    record = state.runs >= RECORD_ON_RUN and enabled("PYGGML_CUDA_REPLAY") and not state.eager
    with recording(record) as rec:
        run_ops()
    if rec is not None:
        if rec.replayable:
            state.launches = rec
        else:
            state.eager = True  # its ops will not change: do not try again

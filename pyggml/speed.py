"""How fast a device multiplies: the figure ``-ngl auto`` places layers by (models/placement.py).

A decoding step reads every weight once, so a layer's share of a token costs its bytes over
the rate at which the device streams quantized weights through a product.  :func:`measure`
times exactly that: a Q4_0 matrix of 8192 x 8192 (36 MiB, past most caches) times one
column, the median of a few runs after one that warms up, in GB/s of weights.  An RPC server measures its devices once,
when it starts, and tells every client (GET_DEVICE_INFO); a client measures its own GPUs.
"""
from __future__ import annotations

import time

import numpy as np

from .backend import BufferUsage, Device, DeviceType, alloc_tensors, tensor_set
from .graph import build_forward
from .sched import Scheduler
from .tensor import new_tensor
from .types import Type

ROWS = COLS = 8192
RUNS = 9


def measure(device: Device, rows: int = ROWS, cols: int = COLS, runs: int = RUNS) -> float:
    """GB/s of Q4_0 weights a one-column product reads on ``device`` (the median of ``runs``)."""
    from . import cpu_device, ops
    from .quants.layouts import LAYOUTS
    w = new_tensor(Type.Q4_0, (cols, rows), "speed.w")
    x = new_tensor(Type.F32, (cols, 1), "speed.x")
    out = ops.mul_mat(w, x)
    buffer = alloc_tensors([w, x], device.get_buffer_type(), BufferUsage.ANY)
    try:
        rng = np.random.default_rng(0)
        blocks = rng.integers(0, 256, size=w.nbytes(), dtype=np.uint8)
        blocks.view(LAYOUTS[Type.Q4_0])["d"] = np.float16(0.01)  # finite sums: no slow path for inf/NaN
        tensor_set(w, blocks)
        tensor_set(x, rng.standard_normal(cols).astype(np.float32))
        graph = build_forward(out)
        backends = [device.init_backend()] + ([] if device.get_type() == DeviceType.CPU else
                                             [cpu_device().init_backend()])
        sched = Scheduler(backends)
        sched.graph_compute(graph)  # the plan made, kernels loaded
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            sched.graph_compute(graph)
            times.append(time.perf_counter() - t0)
        sched.free()
        return w.nbytes() / float(np.median(times)) / 1e9
    finally:
        buffer.free()

"""Shared fixtures: the CPU backend, a graph runner, and the real models (fetched once)."""
from __future__ import annotations

import numpy as np
import pytest

import pyggml as pg
from pyggml import hub


@pytest.fixture(scope="session")
def cpu():
    return pg.cpu_device().init_backend()


def run_graph(out: pg.Tensor, inputs: dict[pg.Tensor, np.ndarray], backends=None) -> np.ndarray:
    """Allocate inputs and intermediates, set inputs, compute, return out's values."""
    graph = pg.build_forward(out)
    sched = pg.Scheduler(backends or [pg.cpu_device().init_backend()])
    sched.alloc_graph(graph)
    for t, v in inputs.items():
        pg.tensor_set(t, np.ascontiguousarray(v))
    sched.graph_compute(graph)
    return pg.tensor_array(out)


@pytest.fixture(scope="session")
def smollm2_path():
    return hub.fetch("smollm2")


@pytest.fixture(scope="session")
def gemma3_path():
    return hub.fetch("gemma3-270m")

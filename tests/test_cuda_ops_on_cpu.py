"""The CUDA backend's op table (pyggml/cuda/ops.py) run on numpy, without a GPU.

The op functions are CuPy array code: with numpy standing in for CuPy, host buffers for
device buffers, and numpy versions of the two kernel launches (dequantize, q8_1
matrix-vector; the kernels themselves are checked in test_cuda_kernels.py), every case of
tests/test_cuda.py runs here against the CPU backend.  This checks the op table's shapes,
indexing and semantics; what only a GPU can show (CuPy's behaviour, the kernels' launches)
is left to tests/test_cuda.py.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import pyggml as pg
from pyggml.backend import Backend
from pyggml.cpu import CPUDevice
from pyggml.cpu import buffer as host
from pyggml.ops import VIEW_OPS

from . import test_cuda


class NumpyCUDABackend(Backend):
    def __init__(self, device, table) -> None:
        self.device, self.table = device, table

    def get_name(self) -> str:
        return self.device.get_name()

    def get_device(self):
        return self.device

    def graph_compute(self, graph) -> None:
        for node in graph.nodes:
            if node.op not in VIEW_OPS:
                self.table[node.op](node)


class NumpyCUDADevice(CPUDevice):
    def __init__(self, table) -> None:
        super().__init__("CUDA-on-numpy")
        self.table = table

    def init_backend(self):
        return NumpyCUDABackend(self, self.table)

    def get_type(self):
        return pg.DeviceType.GPU


@pytest.fixture
def numpy_gpu(monkeypatch):
    from pyggml.cuda import ops as cops

    def dequantize(rows, qtype, ncols, dtype):
        return pg.quants.dequantize(np.ascontiguousarray(rows), qtype).reshape(rows.shape[0], ncols).astype(dtype)

    def mul_mat_vec_q(w, qtype, x, out):
        out[...] = x @ dequantize(w, qtype, x.shape[1], np.float32).T

    monkeypatch.setattr(cops, "_cp", lambda: np)
    monkeypatch.setattr(cops, "tensor_view", host.tensor_view)
    monkeypatch.setattr(cops, "tensor_rows", host.tensor_rows)
    monkeypatch.setattr(cops, "dequantize", dequantize)
    monkeypatch.setattr(cops, "mul_mat_vec_q", mul_mat_vec_q)
    monkeypatch.setattr(test_cuda, "GPUS", [NumpyCUDADevice(cops.OP_TABLE)])


def cases(fn) -> list[dict]:
    """The keyword arguments of every parametrized case of a test function."""
    grids = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize":
            names = [n.strip() for n in mark.args[0].split(",")]
            grids.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in mark.args[1]])
    return [dict(kv for d in combo for kv in d.items()) for combo in itertools.product(*grids)]


TESTS = [name for name in dir(test_cuda) if name.startswith("test_") and "real_model" not in name]


@pytest.mark.parametrize("name", TESTS)
def test_case_runs_on_the_numpy_stand_in(numpy_gpu, name):
    fn = getattr(test_cuda, name)
    for kwargs in cases(fn) or [{}]:
        fn(**kwargs)

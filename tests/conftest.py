"""Shared fixtures: the CPU backend, a graph runner, and the real models (fetched once)."""
from __future__ import annotations

import numpy as np
import pytest

import pyggml as pg
from pyggml.models import hub


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


REFERENCES = {"smollm2": "smollm2-135m-q4_1", "gemma3-270m": "gemma3-270m-q4_k_m"}


def reference(alias: str) -> dict:
    """llama.cpp's outputs for a model (copied from ../shared/reference)."""
    import json
    from pathlib import Path
    return json.loads((Path(__file__).parent / "data" / f"{REFERENCES[alias]}.public.json").read_text())


_models: dict = {}


def shared_model(alias: str):
    """One pyggml.Model per alias for the whole session (loading Gemma takes seconds)."""
    if alias not in _models:
        _models[alias] = pg.Model(alias, n_ctx=1024, progress=False)
    return _models[alias]


@pytest.fixture(params=["smollm2", "gemma3-270m"])
def any_model(request):
    return shared_model(request.param)


def ggml_activations(x: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray | None]:
    """What ggml's CPU matrix product multiplies a quantized (or F16) weight with: the float
    activations rounded through the weight type's vec_dot_type, written here in plain numpy
    from ggml's quantize_row_* code.  For Q8_1 also the per-block ``s - d*sum(q)`` that
    ggml's Q4_1/Q5_1 dot adds times the block minimum."""
    T = pg.Type
    x = np.asarray(x, dtype=np.float32)
    if qtype == T.F16:
        return x.astype(np.float16).astype(np.float32), None
    if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS):
        xb = x.reshape(*x.shape[:-1], -1, 256)
        vmax = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
        with np.errstate(divide="ignore"):
            iscale = np.where(vmax != 0, np.float32(-127) / vmax, 0).astype(np.float32)
            d = np.where(iscale != 0, np.float32(1) / iscale, 0).astype(np.float32)
        return (np.minimum(np.rint(xb * iscale), 127) * d).reshape(x.shape), None
    if qtype not in (T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL, T.MXFP4, T.Q4_1, T.Q5_1):
        return x, None
    xb = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        q = np.rint(xb * np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32))
    d = (amax / np.float32(127)).astype(np.float32)
    d16 = d.astype(np.float16).astype(np.float32)
    corr = None
    if qtype in (T.Q4_1, T.Q5_1):
        qsum = q.sum(-1, keepdims=True)
        corr = ((d * qsum).astype(np.float16).astype(np.float32) - d16 * qsum)[..., 0]
    return (q * d16).reshape(x.shape), corr


def ggml_mul_mat_reference(x: np.ndarray, raw: np.ndarray, qtype) -> np.ndarray:
    """x [..., K] times the transpose of weight rows ``raw`` (bytes [M, row_bytes]), in
    float64, with ggml's activation rounding."""
    w = pg.quants.dequantize(raw.view(np.uint8).reshape(raw.shape[0], -1), qtype).astype(np.float64)
    xq, corr = ggml_activations(x, qtype)
    out = xq.astype(np.float64) @ w.T
    if corr is not None:  # block minima (an F16 at byte 2 of each block) times the Q8_1 sum correction
        blocks = raw.view(np.uint8).reshape(raw.shape[0], -1, qtype.type_size)
        mins = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        out += corr.astype(np.float64) @ mins.T
    return out


# -- RPC servers (real processes on 127.0.0.1) -----------------------------------------------------

@pytest.fixture
def start_server():
    """Start ``pyggml-rpc-server`` processes for one test; all are stopped afterwards."""
    from tests.rpc.rpc_helpers import ServerProcess
    started = []

    def start(*args: str, **kw):
        s = ServerProcess(*args, **kw)
        started.append(s)
        return s
    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def rpc_pair(tmp_path_factory):
    """Two servers shared by the model tests (each with its own tensor cache)."""
    from tests.rpc.rpc_helpers import ServerProcess
    servers = [ServerProcess("--cache-dir", str(tmp_path_factory.mktemp(f"cache{i}"))) for i in range(2)]
    yield servers
    for s in servers:
        s.stop()

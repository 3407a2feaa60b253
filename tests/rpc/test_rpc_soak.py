"""Four clients loading a model onto one server, generating and disconnecting, round after
round: every generation is the local one, and after each round the server is back where it
started - its memory accounting exactly, its resident memory within a small margin, its open
file descriptors exactly.

Bounded: ``PYGGML_SOAK_ROUNDS`` rounds (default 3, well under a minute here); set it higher
for a longer soak.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pyggml.models import Context, load_model
from pyggml.models.loader import default_devices
from pyggml.rpc import connect
from pyggml.rpc import protocol as P

from tests.rpc.rpc_helpers import RawClient, ServerProcess
from tests.models.synthetic import Shape, random_weights, write_model

ROUNDS = int(os.environ.get("PYGGML_SOAK_ROUNDS", "3"))
CLIENTS = 4
PROMPT = [5, 17, 3, 99, 42, 7, 64, 1]
STEPS = 8
RSS_MARGIN = 24 << 20  # allocator slack: freed numpy arrays need not go back to the system at once


def greedy(model, n_ctx: int = 64) -> list[int]:
    ctx = Context(model, n_ctx=n_ctx)
    logits = ctx.decode(PROMPT)
    out = []
    for _ in range(STEPS):
        token = int(np.argmax(logits[-1]))
        out.append(token)
        logits = ctx.decode([token])
    ctx.free()
    return out


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def offered(endpoint: str) -> int:
    probe = RawClient(endpoint)
    free = P.DEVICE_MEMORY.unpack(probe.call(P.Command.GET_DEVICE_MEMORY, P.U32.pack(0))[1])[0]
    probe.close()
    return free


def settled(measure, want, timeout: float = 10.0):
    """``measure()`` once it equals ``want`` (the server frees a session when it notices the
    disconnect), or its last value."""
    deadline = time.monotonic() + timeout
    value = measure()
    while value != want and time.monotonic() < deadline:
        time.sleep(0.1)
        value = measure()
    return value


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's memory from /proc")
def test_clients_come_and_go_and_the_server_returns_to_its_baseline(tmp_path):
    s = Shape(n_embd=128, n_layer=4, n_ff=256, n_head=4, n_head_kv=2, n_vocab=256)
    path = write_model(tmp_path / "soak.gguf", "llama", s, random_weights("llama", s, seed=7),
                       types={f"blk.{i}.ffn_up.weight": "Q4_0" for i in range(s.n_layer)})
    want = greedy(load_model(path))
    server = ServerProcess("--mem", "512")
    try:
        def client_round(results: list, i: int) -> None:
            try:
                device = connect(server.endpoint)[0]
                try:
                    model = load_model(path, ngl="0:all", devices=[device, *default_devices()])
                    results[i] = greedy(model)
                    model.free()
                finally:
                    device.conn.close()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                results[i] = e

        def one_round() -> list:
            results: list = [None] * CLIENTS
            threads = [threading.Thread(target=client_round, args=(results, i)) for i in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads), "a client hung"
            return results

        pid = server.proc.pid
        assert one_round() == [want] * CLIENTS  # the first round compiles the server's kernels
        base_free, base_fds = offered(server.endpoint), settled(lambda: fds(pid), None, timeout=0.5)
        base_rss = rss(pid)
        for r in range(ROUNDS):
            assert one_round() == [want] * CLIENTS, f"round {r}"
            assert server.alive()
            assert settled(lambda: offered(server.endpoint), base_free) == base_free, f"round {r}: memory held"
            assert settled(lambda: fds(pid), base_fds) == base_fds, f"round {r}: file descriptors leak"
            assert rss(pid) <= base_rss + RSS_MARGIN, f"round {r}: resident memory {rss(pid)} from {base_rss}"
    finally:
        server.stop()

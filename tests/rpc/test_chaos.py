"""Failover under serving load, as an operator would try it: ``pyggml-server`` over two RPC
servers and a spare with ``--failover``, four clients streaming greedy answers without pause,
and every 20 s a server in use killed with kill -9 and started again on its port 5 s later.
Every request completes with its solo text, none fails, /health is 200 at the end, and the
server's memory does not grow with the losses; and a server whose model no longer fits on
what is alive refuses requests ("recovering") until its servers are back, then serves again."""
from __future__ import annotations

import os
import re
import threading
import time

import httpx
import pytest

from tests.conftest import shared_model
from tests.server.test_server import HTTPServer

PROMPTS = ["Once upon a time, in a land far away,", "The history of the clock begins", "My favourite food is",
           "The best way to learn a language is", "In the middle of the night, the old house",
           "Ten facts about the moon:"]
MAX_TOKENS = 24
CHAOS_SECONDS = float(os.environ.get("PYGGML_CHAOS_SECONDS", "120"))
KILL_EVERY_S, RESTART_AFTER_S = 20.0, 5.0


@pytest.fixture(scope="module")
def solo() -> dict[str, str]:
    m = shared_model("smollm2")
    out = {}
    for p in PROMPTS:
        m.context.clear()  # each prompt read in one call, as the server reads it
        out[p] = m.create_completion(p, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"]
    return out


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) / 1024


def stream(url: str, prompt: str) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                import json
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                text += chunk["choices"][0]["text"]
    return text


def in_use(log_text: str, endpoints: list[str]) -> list[str]:
    """The servers the last placement used (its log line), or the first two before any."""
    placed = re.findall(r"placed on ([^;]+); recovered", log_text)
    if not placed:
        return endpoints[:2]
    return [e for e in endpoints if f"RPC[{e}]" in placed[-1]]


def test_streams_survive_a_server_killed_every_20_s(start_server, solo, tmp_path):
    servers = [start_server(), start_server(), start_server()]
    endpoints = [s.endpoint for s in servers]
    log_path = tmp_path / "chaos.log"
    http = HTTPServer("-m", "smollm2", "-c", "2048", "-np", "4", "--rpc", ";".join(endpoints[:2]),
                      "--rpc-spare", endpoints[2], "--failover", log_path=log_path)
    results: list[tuple[str, str | None, str | None]] = []  # (prompt, text, error)
    stop = threading.Event()

    def client(i: int) -> None:
        n = i
        while not stop.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += 1
            try:
                results.append((prompt, stream(http.url, prompt), None))
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                results.append((prompt, None, str(e)))
    try:
        stream(http.url, PROMPTS[0])  # warm: the graphs of every shape built once
        rss_before = rss_mib(http.proc.pid)
        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for t in clients:
            t.start()
        kills = []
        started = time.monotonic()
        while time.monotonic() - started < CHAOS_SECONDS:
            time.sleep(KILL_EVERY_S)
            alive = [s for s in servers if s.alive()]
            victims = [s for s in alive if s.endpoint in in_use(log_path.read_text(), endpoints)] or alive
            victim = victims[len(kills) % len(victims)]
            victim.kill()
            victim.proc.wait()
            kills.append(victim.endpoint)
            time.sleep(RESTART_AFTER_S)
            servers[servers.index(victim)] = start_server("-p", str(victim.port))
        stop.set()
        for t in clients:
            t.join(180)
        errors = [(p, e) for p, _, e in results if e is not None]
        assert not errors, f"{len(errors)} of {len(results)} requests failed: {errors[:3]}"
        wrong = [(p, t) for p, t, _ in results if t != solo[p]]
        assert not wrong, f"{len(wrong)} of {len(results)} answers differ from their solo text: {wrong[:2]}"
        assert len(results) >= 8 and len(kills) >= int(CHAOS_SECONDS // (KILL_EVERY_S + RESTART_AFTER_S))
        deadline = time.monotonic() + 30
        while httpx.get(http.url + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert httpx.get(http.url + "/health").status_code == 200
        grown = rss_mib(http.proc.pid) - rss_before
        assert grown < 200, f"the server grew by {grown:.0f} MiB over {len(kills)} losses"
        text = log_path.read_text()
        assert text.count("recovered in") >= len(kills) and "reattached" in text  # taken back while serving
        metrics = httpx.get(http.url + "/metrics").text
        assert re.search(r"^pyggml_device_losses_total [1-9]", metrics, re.M), metrics
    finally:
        stop.set()
        http.stop()


def test_a_model_that_no_longer_fits_waits_for_its_servers_and_serves_again(start_server, solo, monkeypatch):
    """Its server lost and no room left (this client may hold no layer, as a small machine
    could not): the request in flight ends with the error, new ones are refused "recovering"
    instead of for ever, and once the server is back the model is placed again and serves."""
    import pyggml as pg
    from pyggml.models import model as model_module
    from pyggml.models.engine import Engine, EngineStopped
    from pyggml.server.openai import submit
    from pyggml.models.placement import PlacementError
    real = model_module.load_model

    def remote_only(path, ngl, devices, **kw):
        if not any(hasattr(d, "conn") for d in devices):
            raise PlacementError("the model does not fit the devices' memory: no RPC server (this test's client "
                                 "holds no layer)")
        return real(path, ngl, devices, **kw)
    monkeypatch.setattr(model_module, "load_model", remote_only)
    server = start_server()
    m = pg.Model("smollm2", n_ctx=512, rpc=server.endpoint, ngl="all", failover=True, progress=False)
    engine = Engine(m, n_parallel=2, n_batch=64)
    try:
        def answer(prompt: str) -> str:
            return submit(engine, prompt, stream=False, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"]
        assert answer(PROMPTS[0]) == solo[PROMPTS[0]]
        port = server.port
        server.kill()
        server.proc.wait()
        with pytest.raises(EngineStopped, match="no room|recovering"):
            answer(PROMPTS[1])
        assert engine.failure is not None and "recovering" in engine.failure
        with pytest.raises(EngineStopped, match="recovering"):
            answer(PROMPTS[1])
        start_server("-p", str(port))
        deadline = time.monotonic() + 30
        while engine.failure is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.failure is None and engine.stats.reattached == 1
        assert answer(PROMPTS[1]) == solo[PROMPTS[1]]
    finally:
        engine.close()
        m.close()

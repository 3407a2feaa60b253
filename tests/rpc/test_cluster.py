"""A cluster with nothing to configure, on servers in network namespaces of their own joined by
a bridge as hosts on one LAN, the client here on the bridge: servers announce themselves
(--announce) and clients find them (--rpc auto, rpc/discovery.py); a server stopped with
SIGTERM hands its work over before it exits (Status.LEAVING), failover or not."""
from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

import pyggml as pg
from pyggml.models import hub
from pyggml.rpc.file_identity import file_identity
from pyggml.rpc import load_key
from pyggml.models import Engine
from pyggml.rpc.discovery import browse, connect_auto, parse, parse_auto, txt_record
from pyggml.rpc.protocol import PROTOCOL_VERSION
from pyggml.server.openai import submit

from tests.conftest import shared_model
from tests.rpc.rpc_helpers import HostedServers, ServerProcess, bridged_namespaces, namespaces_or_skip


@pytest.fixture(scope="module")
def lan():
    """[(namespace, address)] of two hosts on a bridge with this one; skipped where namespaces
    cannot be made."""
    yield from namespaces_or_skip(lambda: bridged_namespaces(2))


@pytest.fixture
def remote(lan):
    """start(i, *args): an announcing server on host i; all are stopped afterwards."""
    servers = HostedServers()

    def start(i: int, *args: str) -> ServerProcess:
        s = servers.start(*lan[i], "--announce", *args)
        assert any("announced as" in line for line in s.banner), s.banner
        return s
    yield start
    servers.stop()


def test_discovery_finds_both_servers_with_their_memory_and_files(remote):
    path = hub.resolve("smollm2")
    a, b = remote(0, "--mem", "120M", "--gguf", str(path)), remote(1, "--mem", "300M")
    found = {f.endpoint: f for f in browse(timeout=15, want=2)}
    assert {a.endpoint, b.endpoint} <= set(found), found
    fa, fb = found[a.endpoint], found[b.endpoint]
    assert fa.skipped is None and fb.skipped is None and fa.protocol == PROTOCOL_VERSION and not fa.tls
    assert [total for _, _, total in fa.devices] == [120 << 20] and [t for _, _, t in fb.devices] == [300 << 20]
    assert fa.files == [file_identity(path).hex()] and fb.files == []


def test_a_model_placed_over_the_servers_it_found(remote):
    a, b = remote(0), remote(1)
    with pg.Model("smollm2", n_ctx=256, rpc="auto:2", discover_timeout=20, progress=False) as m:
        assert {d.conn.endpoint for d in m.rpc_devices} == {a.endpoint, b.endpoint}
        assert set(m.model.placement.layers[:-1]) <= {0, 1} and len(set(m.model.placement.layers)) >= 2
        ids = m.tokenize("The capital of France is")
        assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))


def test_servers_a_client_cannot_use_are_listed_with_why(remote, tmp_path, caplog):
    if shutil.which("openssl") is None:
        pytest.skip("making TLS keys needs the openssl command")
    key = tmp_path / "k"
    subprocess.run([sys.executable, "-m", "pyggml.cli.rpc_server", "--gen-key", str(key)], check=True,
                   capture_output=True)
    tls, plain = remote(0, "--key", str(key)), remote(1)
    with caplog.at_level(logging.WARNING, logger="pyggml.rpc.discovery"):
        devices = connect_auto("auto", timeout=6)  # no key: the TLS server is skipped, said why
    assert {d.conn.endpoint for d in devices} == {plain.endpoint}
    assert f"{tls.endpoint}" in caplog.text and "it wants TLS: give its client key with --rpc-key" in caplog.text
    for d in devices:
        d.conn.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pyggml.rpc.discovery"):
        devices = connect_auto("auto", key=load_key(f"{key}.client"), timeout=5)
    assert {d.conn.endpoint for d in devices} == {tls.endpoint}
    assert f"{plain.endpoint}" in caplog.text and "did not accept this client" in caplog.text
    for d in devices:
        d.conn.close()
    with pytest.raises(ValueError, match=r"--rpc auto:3: 1 usable RPC server\(s\) found in 3 s \(need 3\)"):
        connect_auto("auto:3", key=None, timeout=3)


def test_show_devices_lists_the_servers_found(remote):
    a = remote(0, "--mem", "150M")
    r = subprocess.run([sys.executable, "-m", "pyggml.cli.chat", "--rpc", "auto", "--discover-timeout", "5",
                        "--show-devices"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"RPC[{a.endpoint}]" in r.stdout and "150 MiB free of 150 MiB" in r.stdout


def test_announcements_are_parsed_with_bounds():
    """A TXT record is data from the network: another protocol version, a malformed entry, an
    unknown transport, no address - each makes the server skipped, with why; never an error."""
    props = {k.encode(): v.encode() for k, v in
             txt_record([("CPU", 1 << 20, 2 << 20)], "tcp", False, ["ab" * 32]).items()}
    ok = parse("h-1._pyggml-rpc._tcp.local.", ["10.0.0.5"], 5000, props)
    assert (ok.endpoint, ok.name, ok.skipped, ok.devices, ok.files) == \
        ("10.0.0.5:5000", "h-1", None, [("CPU", 1 << 20, 2 << 20)], ["ab" * 32])
    zmq = parse("h", ["10.0.0.5"], 5000, {**props, b"transport": b"zmq"})
    assert zmq.endpoint == "zmq://10.0.0.5:5000" and zmq.skipped is None
    cases = {b"proto": (b"3", "protocol version 3"), b"dev0": (b"CPU;x;1", "malformed"),
             b"transport": (b"udp", "unknown transport"), b"devices": (b"\xff\xfe", "malformed")}
    for field, (value, why) in cases.items():
        assert why in parse("h", ["10.0.0.5"], 5000, {**props, field: value}).skipped
    assert "no IPv4 address" in parse("h", [], 5000, props).skipped
    huge = {f"gguf{i}".encode(): b"x" * 64 for i in range(10_000)}  # read up to MAX_FILES, no further
    many = parse("h", ["10.0.0.5"], 5000, {**props, b"files": b"10000", **huge})
    assert many.skipped is None and len(many.files) == 32


def test_rpc_auto_spellings():
    assert parse_auto("auto") == 0 and parse_auto("AUTO:3") == 3
    assert parse_auto("8080;8081") is None and parse_auto(None) is None and parse_auto(["auto"]) is None
    for bad in ("auto:0", "auto:x", "automatic"):
        with pytest.raises(ValueError, match="'auto' or 'auto:N'"):
            parse_auto(bad)


def test_a_server_stopped_during_an_answer_hands_its_layers_over(remote):
    """SIGTERM to a server while the model generates (no failover): no error, the answer the
    model gives alone, and the server exits once the client has let go of it."""
    local = shared_model("smollm2")
    local.context.clear()  # the prompt read in one call, as the fresh model reads it
    ids = local.tokenize("Once upon a time, in a land far away,")
    want = list(local.generate(ids, max_tokens=24, temperature=0))
    a, b = remote(0), remote(1)
    with pg.Model("smollm2", n_ctx=256, rpc=[a.endpoint, b.endpoint], progress=False) as m:
        assert not m.failover
        got = []
        for i, token in enumerate(m.generate(ids, max_tokens=24, temperature=0)):
            got.append(token)
            if i == 6:
                a.proc.send_signal(signal.SIGTERM)
        assert got == want
        assert a.proc.wait(30) == 0  # gone once the client let go (well before --leave-timeout)
        assert {d.conn.endpoint for d in m.rpc_devices} == {b.endpoint} and not m.lost_endpoints


def test_servers_leave_a_serving_engine_mid_stream_and_while_idle(remote):
    """The same under an Engine's streams (no failover): the stream goes on with the same text;
    then a server stopped while the engine is idle is let go within seconds (the engine asks),
    and the next request is answered on what is left."""
    prompt = "The history of the printing press begins"
    local = shared_model("smollm2")
    want = local.create_completion(prompt, max_tokens=20, temperature=0)["choices"][0]["text"]
    a, b = remote(0), remote(1)
    with pg.Model("smollm2", n_ctx=512, rpc=[a.endpoint, b.endpoint], progress=False) as m, \
            Engine(m, n_parallel=2, n_batch=64) as engine:
        text = []
        for i, chunk in enumerate(submit(engine, prompt, max_tokens=20, temperature=0)):
            text.append(chunk["choices"][0]["text"])
            if i == 5:
                a.proc.send_signal(signal.SIGTERM)
        assert "".join(text) == want and engine.stats.departures == 1 and engine.stats.errors == 0
        assert a.proc.wait(30) == 0
        t0 = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)  # idle now
        assert b.proc.wait(30) == 0 and time.monotonic() - t0 < 15
        assert engine.stats.departures == 2 and not m.rpc_devices
        r = submit(engine, prompt, stream=False, max_tokens=20, temperature=0)
        assert r["choices"][0]["text"] == want


def test_a_second_signal_exits_at_once(remote):
    a = remote(0)
    with pg.Model("smollm2", n_ctx=128, rpc=[a.endpoint], progress=False):  # holds buffers there
        a.proc.send_signal(signal.SIGTERM)  # the client is not asked to move: the server waits ...
        time.sleep(1.0)
        assert a.proc.poll() is None
        a.proc.send_signal(signal.SIGTERM)  # ... until a second signal
        assert a.proc.wait(10) == 0


def test_a_server_that_appears_joins_a_serving_engine(remote):
    """A model placed over the servers found (--rpc auto) keeps looking: a server that announces
    itself during a stream (450 tokens over RPC: several seconds) is taken in at a step boundary
    (the model placed anew over both, the cache rebuilt by replay), and the stream's text is the
    one it has without the join."""
    prompt = "Here is a long list of the countries of Europe and their capitals:\n"
    want = shared_model("smollm2").create_completion(prompt, max_tokens=450, temperature=0)["choices"][0]["text"]
    a = remote(0)
    with pg.Model("smollm2", n_ctx=512, rpc="auto:1", discover_timeout=20, progress=False) as m, \
            Engine(m, n_parallel=2, n_batch=64) as engine:
        assert [d.conn.endpoint for d in m.rpc_devices] == [a.endpoint]
        started: list[ServerProcess] = []
        joiner = threading.Thread(target=lambda: started.append(remote(1)))
        text = []
        began = time.time()
        joiner.start()  # it announces itself once started (seconds): by then the stream runs
        for chunk in submit(engine, prompt, max_tokens=450, temperature=0):
            text.append(chunk["choices"][0]["text"])
        ended = time.time()
        joiner.join(120)
        assert "".join(text) == want
        joined = [e for e in engine.events if e["event"] == "joined"]
        assert [e["detail"] for e in joined] == [started[0].endpoint] and began < joined[0]["time"] < ended
        assert {d.conn.endpoint for d in m.rpc_devices} == {a.endpoint, started[0].endpoint}
        assert engine.stats.joined == 1 and engine.stats.errors == 0
        holds = {d["endpoint"]: d["holds"] for d in engine.cluster()["devices"]}
        assert holds[a.endpoint] != "nothing" and holds[started[0].endpoint] != "nothing"


def test_the_cluster_page_shows_both_servers(remote, tmp_path):
    """GET /cluster: JSON for a client, and for a browser the live view, which lists the
    servers, what they hold and the events (tested in the headless browser of the chat page)."""
    from tests.server.test_chat_page import browser_or_skip
    from tests.server.test_server import HTTPServer
    a, b = remote(0), remote(1)
    server = HTTPServer("-m", "smollm2", "-c", "512", "-np", "2", "--rpc", "auto:2", "--discover-timeout", "20",
                        log_path=tmp_path / "server.log")
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the step loop refreshes what /cluster says
            c = httpx.get(server.url + "/cluster", headers={"Accept": "application/json"}, timeout=10).json()
            if {d["endpoint"] for d in c["devices"]} >= {a.endpoint, b.endpoint}:
                break
            time.sleep(0.5)
        assert {d["endpoint"] for d in c["devices"]} >= {a.endpoint, b.endpoint}, c
        assert all(d["memory_total"] > 0 for d in c["devices"]) and c["counts"]["lost"] == 0
        html = httpx.get(server.url + "/cluster", headers={"Accept": "text/html"}, timeout=10)
        assert html.headers["content-type"].startswith("text/html") and "pyggml cluster" in html.text
        browser = browser_or_skip()
        try:
            from selenium.webdriver.common.by import By
            from selenium.webdriver.support.ui import WebDriverWait
            browser.get(server.url + "/cluster")
            WebDriverWait(browser, 30).until(lambda br: len(br.find_elements(By.CSS_SELECTOR, "tr.device")) >= 2)
            rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "tr.device")]
            assert any(a.endpoint in r for r in rows) and any(b.endpoint in r for r in rows), rows
            browser.save_screenshot(str(tmp_path / "cluster.png"))
        finally:
            browser.quit()
    finally:
        server.stop()


def test_rpc_server_metrics(tmp_path):
    """--metrics-port: the server's sessions, bytes, requests, compute seconds, memory and tensor
    cache in Prometheus's format, moving as a client uses it."""
    from prometheus_client.parser import text_string_to_metric_families
    server = ServerProcess("--metrics-port", "0", "--cache-dir", str(tmp_path / "cache"), "--mem", "500M")
    try:
        url = re.search(r"metrics: (http://\S+)", "\n".join(server.banner)).group(1)

        def scrape() -> dict[str, float]:
            text = httpx.get(url, timeout=10).text
            return {s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items())): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples}
        before = scrape()
        assert before["pyggml_rpc_sessions[kind=client]"] == 0 and before["pyggml_rpc_leaving"] == 0
        assert before["pyggml_rpc_device_memory_bytes[device=0][kind=total][name=CPU]"] == 500 << 20
        with pg.Model("smollm2", n_ctx=128, rpc=server.endpoint, ngl="all", progress=False) as m:
            m.logits(m.tokenize("Hello there"))
            during = scrape()
        assert during["pyggml_rpc_sessions[kind=client]"] == 1 and during["pyggml_rpc_clients_holding_memory"] == 1
        assert during["pyggml_rpc_device_memory_bytes[device=0][kind=used][name=CPU]"] > 50 << 20
        assert during["pyggml_rpc_requests_total[command=GRAPH_COMPUTE]"] >= 1
        assert during["pyggml_rpc_compute_seconds_total"] > 0
        assert during["pyggml_rpc_peer_wait_seconds_total"] == 0  # (one server: nothing from others)
        assert during["pyggml_rpc_bytes_received_total"] > 50 << 20  # the weights, uploaded
        assert during["pyggml_rpc_bytes_sent_total"] > 0
        assert during["pyggml_rpc_cache_events_total[event=stores]"] > 0
        assert httpx.get(url.replace("/metrics", "/other"), timeout=10).status_code == 404
    finally:
        server.stop()


def test_placement_by_measured_speed(remote):
    """-ngl auto places by each device's measured speed (an RPC server times its products when
    it starts and reports it): of two servers on this machine, one with -t 1 and one with -t 2,
    the faster gets the larger share, in proportion to the speeds they report (on a 2-core
    machine whose cores share the memory bandwidth, -t 2 measures about 1.4x -t 1: ~58% of the
    layers, not two thirds); --place-by memory splits them evenly by their equal --mem."""
    slow, fast = remote(0, "-t", "1", "--mem", "400M"), remote(1, "-t", "2", "--mem", "400M")
    try:
        speeds = [float(re.search(r", ([\d.]+) GB/s through products", "\n".join(s.banner)).group(1))
                  for s in (slow, fast)]
        assert min(speeds) > 0  # (which one measures faster is the machine's to say: a noisy one may not agree)
        plans: list[str] = []
        with pg.Model("smollm2", n_ctx=256, rpc=[slow.endpoint, fast.endpoint], progress=False,
                      on_plan=plans.append) as m:
            layers = m.model.placement.layers
            faster = int(speeds[1] > speeds[0])
            assert layers.count(faster) >= layers.count(1 - faster) > 0, (layers, speeds)
            assert abs(layers.count(1) - len(layers) * speeds[1] / sum(speeds)) <= 1.5, (layers, speeds)
            ids = m.tokenize("The capital of France is")
            assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))
        assert "measured" in plans[0].splitlines()[0] and "GB/s" in plans[0] and "ms round trip" in plans[0]
        with pg.Model("smollm2", n_ctx=256, rpc=[slow.endpoint, fast.endpoint], progress=False,
                      place_by="memory") as m:
            assert abs(m.model.placement.layers.count(0) - m.model.placement.layers.count(1)) <= 2
    finally:
        slow.stop()
        fast.stop()

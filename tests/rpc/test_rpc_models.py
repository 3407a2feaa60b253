"""Real models through real RPC server processes: the same logits and tokens as a local run,
clear errors when a server dies, hangs, is unreachable or speaks another protocol, the
tensor cache, and TLS."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

import pyggml as pg
from pyggml.rpc import RPCError, connect, load_key
from pyggml.rpc import protocol as P
from pyggml.models.runner import shape_bucket

from tests.conftest import reference, shared_model
from tests.rpc.rpc_helpers import assert_keyed_model_is_exact, RawClient

# (placement, servers used): everything on one server; embedding and head on one server and
# every layer on another; the embedding and the first layers remote, the rest on the local CPU
PLACEMENTS = {
    "smollm2": [("all", 1), ("0:prolog,epilog;1:all", 2), ("0:prolog,12", 1)],
    "gemma3-270m": [("all", 1), ("0:prolog,epilog;1:all", 2), ("0:prolog,9", 1)],
}


def prompt_ids(alias: str) -> list[int]:
    ref = reference(alias)
    return ref["prompts"][0]["tokens"] + ref["prompts"][1]["tokens"][1:]


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_logits_and_greedy_tokens_equal_the_local_run(alias, transport, request):
    rpc_pair = request.getfixturevalue("rpc_pair" if transport == "tcp" else "zmq_rpc_pair")
    local = shared_model(alias)
    ids = prompt_ids(alias)
    want = local.logits(ids)
    want_tokens = list(local.generate(ids[:12], max_tokens=16, temperature=0))
    for ngl, n_servers in PLACEMENTS[alias]:
        endpoints = [s.endpoint for s in rpc_pair[:n_servers]]
        with pg.Model(alias, n_ctx=256, rpc=endpoints, ngl=ngl, progress=False) as remote:
            assert [d.get_name() for d in remote.rpc_devices] == [f"RPC[{e}]" for e in endpoints]
            got = remote.logits(ids)
            # the same kernels on the same bytes in another process: identical, not merely close
            assert np.array_equal(got, want), f"{ngl}: max |diff| {np.abs(got - want).max()}"
            if n_servers == 2:
                assert list(remote.generate(ids[:12], max_tokens=16, temperature=0)) == want_tokens


def test_auto_placement_over_servers_of_different_memory(start_server):
    """-ngl auto (the default with --rpc) by memory: layers in proportion to each server's --mem, the
    embedding with the first layer and the head with the last; logits equal the local run."""
    servers = [start_server("--mem", "100M"), start_server("--mem", "300M")]
    endpoints = [s.endpoint for s in servers]
    local = shared_model("smollm2")
    ids = prompt_ids("smollm2")[:24]
    plans = []
    with pg.Model("smollm2", n_ctx=256, rpc=endpoints, progress=False, on_plan=plans.append,
                  place_by="memory") as m:
        layers = m.model.placement.layers
        first = layers.count(0)
        assert 0 < first < layers.count(1) and layers == [0] * first + [1] * (30 - first)
        assert (m.model.placement.prolog, m.model.placement.epilog) == (0, 1)
        assert np.array_equal(m.logits(ids), local.logits(ids))
    rows = plans[0].splitlines()
    assert f"RPC[{endpoints[0]}]" in rows[1] and f"0-{first - 1},prolog" in rows[1]
    assert f"{first}-29,epilog" in rows[2] and "300 M" in rows[2]


def test_show_placement_dry_run_and_too_large(start_server):
    server = start_server("--mem", "60M")
    r = subprocess.run([sys.executable, "-m", "pyggml.cli.chat", "-m", "smollm2", "--rpc", server.endpoint,
                        "-ts", "1", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "does not fit" in r.stderr and "MiB missing" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pyggml.cli.chat", "-m", "smollm2", "--rpc", server.endpoint,
                        "-ngl", "0:prolog,4", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    assert rows[0].split() == ["id", "device", "layers", "weights", "KV", "free"]
    assert f"RPC[{server.endpoint}]" in rows[1] and "0-3,prolog" in rows[1] and "60 M" in rows[1]
    assert "CPU" in rows[2] and "4-29,epilog" in rows[2]


def test_decode_reuses_the_graph_on_the_server(rpc_pair):
    with pg.Model("smollm2", n_ctx=256, rpc=rpc_pair[0].endpoint, ngl="all", progress=False) as m:
        ids = m.tokenize("Once upon a time")
        conn = m.rpc_devices[0].conn
        tokens = list(m.generate(ids, max_tokens=6, temperature=0))
        backend = m.context.backends[0]
        assert backend.recomputes >= len(tokens) - 2  # the first decode step sends its graph, later ones do not
        sent = conn.bytes_sent
        m.context.decode([tokens[-1]], n_top=shape_bucket(1))  # greedy's step (runner.py rounds its top)
        # the step's inputs (token, position, cache cell, a 256-cell mask) and a GRAPH_RECOMPUTE:
        # ~3 KB, where sending the graph again would be ~300 KB
        assert conn.bytes_sent - sent < 10_000


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_top_k_sampling_leaves_the_vocabulary_on_the_server(alias, rpc_pair):
    """With the head on a server, top-k sampling brings back the top ids and logits (and the
    recent tokens' logits for the penalties), not the row: bytes per generated token stay
    far below the vocabulary's (196 KiB for SmolLM2, 1 MiB for Gemma 3) - and the tokens are
    those of the local run."""
    local = shared_model(alias)
    local.context.clear()
    ids = local.tokenize("Once upon a time, in a land far away,")
    kw = dict(max_tokens=24, temperature=0.8, top_k=40, repeat_penalty=1.1, seed=5)
    want = list(local.generate(ids, **kw))
    with pg.Model(alias, n_ctx=256, rpc=rpc_pair[0].endpoint, ngl="all", progress=False) as m:
        conn = m.rpc_devices[0].conn
        tokens = m.generate(ids, **kw)
        got = [next(tokens), next(tokens)]  # the prompt's graph and the decode step's have gone over
        before = conn.bytes_sent + conn.bytes_received
        got += list(tokens)
        per_token = (conn.bytes_sent + conn.bytes_received - before) / (len(got) - 2)
    assert got == want
    assert per_token < 16_000, per_token


def test_unreachable_server_is_reported_before_any_upload(start_server):
    live = start_server("--mem", "512")  # free memory is then exactly 512 MiB minus what is allocated
    before = connect(live.endpoint)[0].get_memory()
    assert before[0] == 512 << 20
    t0 = time.monotonic()
    with pytest.raises(RPCError, match=r"RPC\[127\.0\.0\.1:1\]"):
        pg.Model("smollm2", rpc=[live.endpoint, "127.0.0.1:1"], ngl="0:all", progress=False)
    assert time.monotonic() - t0 < 8
    assert connect(live.endpoint)[0].get_memory()[0] == before[0]  # nothing was allocated there


def test_other_protocol_version_is_refused(rpc_pair, monkeypatch):
    monkeypatch.setattr(P, "PROTOCOL_VERSION", P.PROTOCOL_VERSION + 1)
    with pytest.raises(RPCError, match="protocol version"):
        connect(rpc_pair[0].endpoint)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_dead_or_hung_server_mid_generation(start_server, how):
    server = start_server()
    m = pg.Model("smollm2", n_ctx=256, rpc=server.endpoint, ngl="all", progress=False)
    stream = m.generate(m.tokenize("Tell me a long story about a dragon"), max_tokens=200, temperature=0)
    next(stream), next(stream)
    server.kill(how)
    t0 = time.monotonic()
    with pytest.raises(RPCError, match=server.endpoint.replace(".", r"\.")):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 5
    with pytest.raises(RPCError):  # the connection stays unusable, with the same clear error
        m.logits([1, 2])


def test_a_decode_step_is_one_round_trip_and_no_graph_is_sent_twice(start_server):
    """A step's inputs, its graph run and its output reads leave in one go and the answers come
    back together; a context going from its prompt graph to its decode graph and back re-runs
    the graphs the server holds."""
    server = start_server()
    m = pg.Model("smollm2", n_ctx=256, rpc=server.endpoint, ngl="all", progress=False)
    ids = m.tokenize("Once upon a time, in a land far away,")
    first = list(m.generate(ids, max_tokens=8, temperature=0, top_k=40))
    conn = m.rpc_devices[0].conn
    m.context.clear()
    trips, sent = conn.round_trips, Counter(conn.sent)
    again = list(m.generate(ids, max_tokens=8, temperature=0, top_k=40))
    assert again == first
    assert conn.sent[P.Command.GRAPH_COMPUTE] == sent[P.Command.GRAPH_COMPUTE]  # none sent again
    assert conn.sent[P.Command.GRAPH_RECOMPUTE] - sent[P.Command.GRAPH_RECOMPUTE] == len(again)
    assert conn.round_trips - trips == len(again)  # the prompt's step and each token's: one each
    local = shared_model("smollm2")
    assert again == list(local.generate(ids, max_tokens=8, temperature=0, top_k=40))


def test_second_load_comes_from_the_tensor_cache(start_server, tmp_path):
    server = start_server("--cache-dir", str(tmp_path / "cache"))
    with pg.Model("smollm2", n_ctx=64, rpc=server.endpoint, ngl="all", progress=False) as first:
        first_bytes = first.rpc_devices[0].conn.bytes_sent
        weights = first.model.weights_nbytes()
    assert first_bytes > 0.9 * weights
    assert len(list((tmp_path / "cache").glob("*.bin"))) > 100
    with pg.Model("smollm2", n_ctx=64, rpc=server.endpoint, ngl="all", progress=False) as second:
        second_bytes = second.rpc_devices[0].conn.bytes_sent
        ids = second.tokenize("The cache")
        assert np.array_equal(second.logits(ids), shared_model("smollm2").logits(ids))
    assert second_bytes < 0.05 * first_bytes, (first_bytes, second_bytes)


def test_corrupt_cache_entry_is_not_used(start_server, tmp_path):
    cache = tmp_path / "cache"
    server = start_server("--cache-dir", str(cache))
    with pg.Model("smollm2", n_ctx=64, rpc=server.endpoint, ngl="all", progress=False):
        pass
    entries = sorted(cache.glob("*.bin"), key=lambda p: p.stat().st_size)
    victim = entries[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pg.Model("smollm2", n_ctx=64, rpc=server.endpoint, ngl="all", progress=False) as m:
        ids = m.tokenize("Corruption is caught")
        assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))
    assert victim.exists() and victim.read_bytes() != bytes(data)  # replaced by the good bytes


@pytest.fixture
def tls_keys(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("making TLS keys needs the openssl command")
    key = tmp_path / "server.key"
    subprocess.run([sys.executable, "-m", "pyggml.cli.rpc_server", "--gen-key", str(key)], check=True,
                   capture_output=True)
    client_key = tmp_path / "server.key.client"
    assert (os.stat(key).st_mode & 0o777) == 0o600 and (os.stat(client_key).st_mode & 0o777) == 0o600
    return key, client_key


def test_tls_accepts_the_right_key_and_rejects_others(start_server, tls_keys, tmp_path):
    server_key, client_key = tls_keys
    server = start_server("--key", str(server_key))
    assert "TLS on" in server.banner[0]
    assert_keyed_model_is_exact(server.endpoint, client_key)
    with pytest.raises(RPCError, match="closed the connection|TLS"):
        connect(server.endpoint, connect_timeout=3)  # no key: a plain client
    other = tmp_path / "other.key"
    subprocess.run([sys.executable, "-m", "pyggml.cli.rpc_server", "--gen-key", str(other)], check=True,
                   capture_output=True)
    with pytest.raises(RPCError, match="TLS"):  # another pair's client key: the server refuses it
        connect(server.endpoint, key=load_key(str(other) + ".client"), connect_timeout=3)
    with pytest.raises(RPCError, match="TLS"):  # our client key, but a server of another pair
        other_server = start_server("--key", str(other))
        connect(other_server.endpoint, key=load_key(client_key), connect_timeout=3)
    raw = RawClient(server.endpoint, hello=False)  # a plain socket cannot even deliver a request
    raw.send_raw([P.HEADER.pack(P.Command.HELLO, 0, 0, 1) + P.HELLO.pack(P.MAGIC, P.PROTOCOL_VERSION)])
    assert raw.recv(timeout=2) is None
    raw.close()
    assert server.alive()


def test_old_curve_keys_get_a_clear_error(tmp_path):
    old = tmp_path / "curve.key.pub"
    old.write_text("rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\n")
    with pytest.raises(ValueError, match="CurveZMQ key from an older pyggml"):
        load_key(old)


def test_a_read_asked_for_early_gets_the_bytes_of_then_and_answers_read_meanwhile_keep(start_server):
    """tensor_arrays_async: the read leaves at once and the server answers it in order - after
    what was sent before and before what is sent after - so a later write does not change what
    it reads, and a request answered while it waits (its answer comes first) leaves it intact."""
    from pyggml.backend import alloc_tensors, tensor_arrays_async
    device = connect(start_server().endpoint)[0]
    try:
        a, b = pg.new_tensor(pg.Type.F32, (64,), "a"), pg.new_tensor(pg.Type.F32, (64,), "b")
        alloc_tensors([a, b], device.get_buffer_type())
        before, after = np.arange(64, dtype=np.float32), -np.arange(64, dtype=np.float32)
        pg.tensor_set(a, before)
        pg.tensor_set(b, after)
        early = tensor_arrays_async([a, b])
        pg.tensor_set(a, after)  # sent after the read: answered after it
        assert np.array_equal(pg.tensor_array(a).ravel(), after)  # waits past the early read's answers
        assert device.conn.answers()
        got = [x.ravel() for x in early()]
        assert np.array_equal(got[0], before) and np.array_equal(got[1], after)
        assert not device.conn._early and not device.conn._unread
    finally:
        device.conn.close()

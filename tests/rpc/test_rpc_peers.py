"""Servers that pass tensors to each other (rpc/peers.py): a model split over two servers sends
its activations from one server straight to the other, with the same bits as locally; a server
that may not link falls back to the path through the client and says so once; and every step of
the introduction and of the copies is checked like any request from the network."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import pyggml as pg
from pyggml.rpc import backend as rpc_backend
from pyggml.rpc import protocol as P

from tests.conftest import shared_model
from tests.rpc.rpc_helpers import RawClient, ServerProcess, tensor
from tests.rpc.test_rpc_validation import alloc, set_data

C = P.Command
PROMPT = "The capital of France is"


def split_run(endpoints: list[str], peers: bool, monkeypatch, rpc_key: str | None = None
              ) -> tuple[np.ndarray, list[int], dict, int]:
    """The prompt's logits and a greedy continuation with the embedding and head on the first
    server and the layers on the second (activations cross between them both ways each step);
    the requests sent to each, and the bytes the client received per generated token."""
    monkeypatch.setattr(rpc_backend, "PEERS", peers)
    m = pg.Model("smollm2", n_ctx=256, rpc=endpoints, rpc_key=rpc_key, ngl="0:prolog,epilog;1:all", progress=False)
    try:
        ids = m.tokenize(PROMPT)
        logits = m.logits(ids)
        list(m.generate(ids, max_tokens=2, temperature=0))
        conns = list({id(d.conn): d.conn for d in m.rpc_devices}.values())
        before = sum(c.bytes_received for c in conns)
        tokens = list(m.generate(ids, max_tokens=16, temperature=0))
        per_token = (sum(c.bytes_received for c in conns) - before) // 16
        sent = {c.endpoint: dict(c.sent) for c in conns}
    finally:
        m.close()
    return logits, tokens, sent, per_token


@pytest.fixture(scope="module")
def two_servers():
    servers = [ServerProcess(), ServerProcess()]
    yield servers
    for s in servers:
        s.stop()


def test_a_split_passes_activations_between_the_servers_with_the_bits_of_a_local_run(two_servers, monkeypatch):
    local = shared_model("smollm2")
    local.context.clear()
    ids = local.tokenize(PROMPT)
    want_logits = local.logits(ids)
    want_tokens = list(local.generate(ids, max_tokens=16, temperature=0))
    endpoints = [s.endpoint for s in two_servers]
    logits, tokens, sent, direct = split_run(endpoints, True, monkeypatch)
    assert np.array_equal(logits, want_logits) and tokens == want_tokens
    assert sent[endpoints[0]].get(C.COPY_TO_PEER) and sent[endpoints[1]].get(C.COPY_TO_PEER)
    assert sent[endpoints[0]].get(C.WAIT_PEER) and sent[endpoints[1]].get(C.WAIT_PEER)
    _, tokens, sent, through = split_run(endpoints, False, monkeypatch)
    assert tokens == want_tokens and not sent[endpoints[0]].get(C.COPY_TO_PEER)
    # through the client, each token's hidden state (576 floats) comes back from the layers' server
    assert through - direct >= 576 * 4, (through, direct)


def test_a_server_that_makes_no_links_falls_back_and_says_so_once(monkeypatch, caplog):
    servers = [ServerProcess("--no-peers"), ServerProcess()]
    try:
        local = shared_model("smollm2")
        local.context.clear()
        want = list(local.generate(local.tokenize(PROMPT), max_tokens=16, temperature=0))
        with caplog.at_level(logging.WARNING, logger="pyggml.rpc"):
            _, tokens, sent, _ = split_run([s.endpoint for s in servers], True, monkeypatch)
        assert tokens == want
        assert not sent[servers[0].endpoint].get(C.COPY_TO_PEER)  # it cannot: --no-peers
        assert sent[servers[1].endpoint].get(C.COPY_TO_PEER)      # the other one can
        said = [r.getMessage() for r in caplog.records if "go through this client" in r.getMessage()]
        assert len(said) == 1 and "--no-peers" in said[0], said
    finally:
        for s in servers:
            s.stop()


# -- the introduction and the copies, request by request -------------------------------------------

@pytest.fixture(scope="module")
def pair():
    servers = [ServerProcess(env={"PYGGML_RPC_PEER_WAIT": "1"}), ServerProcess(env={"PYGGML_RPC_PEER_WAIT": "1"})]
    yield servers
    for s in servers:
        s.stop()


def ok(reply):
    status, body, frames = reply
    assert status == P.Status.OK, body
    return body, frames


def error(reply, match: str) -> str:
    status, body, _ = reply
    assert status == P.Status.ERROR and match.lower() in body.decode().lower(), body
    return body.decode()


def linked(pair) -> tuple[RawClient, RawClient, int]:
    """A client session on each server, and a link from the first server to the second."""
    a, b = RawClient(pair[0].endpoint), RawClient(pair[1].endpoint)
    token, _ = ok(b.call(C.PEER_TOKEN))
    body, _ = ok(a.call(C.PEER_CONNECT, P.PEER_CONNECT.pack(token), [pair[1].endpoint.encode()]))
    return a, b, P.U32.unpack(body)[0]


def test_a_copy_lands_before_the_receivers_next_request(pair):
    a, b, link = linked(pair)
    src_handle, dst_handle = alloc(a), alloc(b)
    values = np.arange(16, dtype=np.float32)
    src = set_data(a, src_handle, values, 0, (16, 1, 1, 1))
    dst = tensor(0, (16, 1, 1, 1), buffer=dst_handle, id=2)
    b.send_raw([P.HEADER.pack(C.WAIT_PEER, P.FLAG_NO_REPLY, 0, 99) + P.U32.pack(7)])  # first: b must hold
    a.send_raw([P.HEADER.pack(C.COPY_TO_PEER, P.FLAG_NO_REPLY, 0, 98) + P.COPY_TO_PEER.pack(link, 7) + src + dst])
    body, frames = ok(b.call(C.GET_TENSOR, dst + P.GET_TENSOR.pack(0, 64, P.Codec.RAW)))
    assert np.array_equal(np.frombuffer(frames[0], np.float32), values)


def test_a_tag_that_never_comes_ends_the_wait_with_an_error(pair):
    """(PYGGML_RPC_PEER_WAIT=1 on these servers); and with no link at all nothing is waited for."""
    a, b, _ = linked(pair)  # (a's session holds the link: keep it)
    b.send_raw([P.HEADER.pack(C.WAIT_PEER, P.FLAG_NO_REPLY, 0, 5) + P.U32.pack(12345)])
    error(b.call(C.DEVICE_COUNT, timeout=10), "no tensor tagged 12345")
    ok(b.call(C.DEVICE_COUNT))  # and it serves again
    alone = RawClient(pair[1].endpoint)
    alone.send_raw([P.HEADER.pack(C.WAIT_PEER, P.FLAG_NO_REPLY, 0, 5) + P.U32.pack(6)])
    error(alone.call(C.DEVICE_COUNT, timeout=0.9), "the server sending tensor 6 is gone (no link)")
    a.close()


def test_tokens_are_one_time_and_a_link_may_only_write(pair):
    a, b = RawClient(pair[0].endpoint), RawClient(pair[1].endpoint)
    token, _ = ok(b.call(C.PEER_TOKEN))
    intruder = RawClient(pair[1].endpoint)
    error(intruder.call(C.PEER_AUTH, bytes(32)), "unknown, used or expired")
    ok(intruder.call(C.PEER_AUTH, token))
    error(RawClient(pair[1].endpoint).call(C.PEER_AUTH, token), "unknown, used or expired")  # once only
    error(intruder.call(C.ALLOC_BUFFER, P.ALLOC_BUFFER.pack(0, 4096)), "may only send PEER_SET")
    error(a.call(C.PEER_SET, P.PEER_SET.pack(1, 0) + tensor(0), [bytes(64)]), "only over a link")
    # a link writes only into its own session's buffers: another client's handle is unknown
    other = alloc(RawClient(pair[1].endpoint))
    waiting = RawClient(pair[1].endpoint)
    token, _ = ok(waiting.call(C.PEER_TOKEN))
    link = RawClient(pair[1].endpoint)
    ok(link.call(C.PEER_AUTH, token))
    link.send_raw([P.HEADER.pack(C.PEER_SET, P.FLAG_NO_REPLY, 0, 3) + P.PEER_SET.pack(4, 0)
                   + tensor(0, buffer=other), bytes(64)])
    waiting.send_raw([P.HEADER.pack(C.WAIT_PEER, P.FLAG_NO_REPLY, 0, 9) + P.U32.pack(4)])
    error(waiting.call(C.DEVICE_COUNT), "unknown buffer handle")


def test_an_unreachable_or_refusing_server_is_an_error_and_both_keep_serving(pair):
    a, b = RawClient(pair[0].endpoint), RawClient(pair[1].endpoint)
    error(a.call(C.PEER_CONNECT, P.PEER_CONNECT.pack(bytes(32)), [b"127.0.0.1:1"], timeout=20), "cannot link to")
    error(a.call(C.PEER_CONNECT, P.PEER_CONNECT.pack(bytes(32)), [pair[1].endpoint.encode()]), "cannot link to")
    error(a.call(C.PEER_CONNECT, P.PEER_CONNECT.pack(bytes(32)), [b"not an endpoint"]), "bad rpc endpoint")
    error(a.call(C.PEER_CONNECT, P.PEER_CONNECT.pack(bytes(32)), [b"localhost:80"]), "numeric address")
    error(a.call(C.PEER_CONNECT, P.PEER_CONNECT.pack(bytes(32)), [b"192.0.2.1:80"]), "not on this server's networks")
    error(a.call(C.COPY_TO_PEER, P.COPY_TO_PEER.pack(9, 1) + tensor(0) + tensor(0)), "no link 9")
    ok(a.call(C.DEVICE_COUNT))
    ok(b.call(C.DEVICE_COUNT))
    assert pair[0].alive() and pair[1].alive()


def test_servers_of_one_key_pair_link_over_tls(tmp_path, monkeypatch):
    """With TLS, a server links to another with its own key file: the authority of the pair
    signed its certificate for both ends of a connection."""
    import shutil
    import subprocess
    import sys
    if shutil.which("openssl") is None:
        pytest.skip("making TLS keys needs the openssl command")
    subprocess.run([sys.executable, "-m", "pyggml.cli.rpc_server", "--gen-key", str(tmp_path / "k")],
                   check=True, capture_output=True)
    local = shared_model("smollm2")
    local.context.clear()
    want = list(local.generate(local.tokenize(PROMPT), max_tokens=16, temperature=0))
    servers = [ServerProcess("--key", str(tmp_path / "k")), ServerProcess("--key", str(tmp_path / "k"))]
    try:
        _, tokens, sent, _ = split_run([s.endpoint for s in servers], True, monkeypatch, str(tmp_path / "k.client"))
        assert tokens == want and all(sent[s.endpoint].get(C.COPY_TO_PEER) for s in servers)
    finally:
        for s in servers:
            s.stop()



def test_a_wait_ends_when_the_sending_server_dies_and_the_held_client_hears_heartbeats():
    """A session that waits for a tagged tensor is held, not forgotten: its server keeps sending
    it heartbeats (its client must not take the wait for a dead server), and when the sending
    server dies the wait ends at once with an error naming what is missing."""
    import time
    servers = [ServerProcess(), ServerProcess()]
    try:
        a, b, link = linked(servers)
        b.send_raw([P.HEADER.pack(C.WAIT_PEER, P.FLAG_NO_REPLY, 0, 50) + P.U32.pack(77)])
        b.send_raw([P.HEADER.pack(C.DEVICE_COUNT, 0, 0, 51)])
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):  # not "silence": heartbeats kept coming
            b.channel.recv(time.monotonic() + 4.5, silence=2.0)
        servers[0].kill()
        reply = b.recv(timeout=10)
        assert reply is not None and time.monotonic() - t0 < 12
        error(reply, "the server sending tensor 77 is gone")
        ok(b.call(C.DEVICE_COUNT))
    finally:
        for s in servers:
            s.stop()


def test_a_prompt_of_several_ubatches_keeps_each_ubatchs_tensors_apart(two_servers, monkeypatch):
    """A long prompt is read in ubatches without waiting between them, so the sender may send
    the second ubatch's activations before the receiver computed the first: each must land only
    when the receiver's own requests reach it (the logits are a local run's, bit for bit)."""
    monkeypatch.setattr(rpc_backend, "PEERS", True)
    text = " ".join(f"word{i}" for i in range(120))
    local = pg.Model("smollm2", n_ctx=512, n_batch=32, progress=False)
    ids = local.tokenize(text)
    assert len(ids) > 3 * 32
    want = local.logits(ids)
    # the layers split between the servers, the head on the second: only the first sends, so
    # the second's requests wait in this client until the prompt's last ubatch reads the result
    m = pg.Model("smollm2", n_ctx=512, n_batch=32, rpc=[s.endpoint for s in two_servers], progress=False)
    try:
        assert m.model.placement.layers[0] != m.model.placement.layers[-1]
        assert np.array_equal(m.context.decode(ids)[-1], want[-1])
        m.context.clear()
        assert np.array_equal(m.logits(ids), want)
    finally:
        m.close()
        local.close()


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_a_prompt_over_two_servers_is_pipelined_with_the_bits_of_one_ubatch(two_servers, alias):
    """A prompt whose layers lie on two servers is read in micro-batches (Context.n_micro) that
    do not wait for each other, so the two servers work at once; every token still meets the
    kernels of the whole ubatch (Gemma's K-quants too), so the logits are a local run's."""
    local = shared_model(alias)
    local.context.clear()
    text = " ".join(f"item {i}," for i in range(60))
    ids = local.tokenize(text)
    want = local.context.decode(ids)[-1]
    local.context.clear()
    with pg.Model(alias, n_ctx=512, rpc=[s.endpoint for s in two_servers], progress=False) as m:
        ctx = m.context
        assert ctx.n_micro == 64 and len(ids) > 2 * ctx.n_micro
        pieces = ctx._pieces(pg.models.context.Batch.of(np.array(ids), 0, 0, "last"))
        rules = ctx.rules  # (Gemma's: pieces in eights, the last of 8 or more; SmolLM2's: of 2 or more)
        assert len(pieces) >= 3 and all((b - a) % rules.piece_align == 0 for a, b in pieces[:-1])
        assert pieces[-1][1] - pieces[-1][0] >= rules.tiled_min_cols
        assert np.array_equal(ctx.decode(ids)[-1], want)


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_a_decode_step_of_several_sequences_over_two_servers_is_cut_into_groups_with_local_bits(
        two_servers, alias, monkeypatch):
    """A server's decode step - the next token of several sequences and a waiting prompt, in
    one batch - over two servers is computed in groups of whole sequences that do not wait for
    each other (Context.n_groups): each group's outputs are asked for as its graph is sent and
    read once all are on their way.  They come back in batch order, top-k and whole rows, with
    the bits of the local run."""
    from pyggml.models import context as context_module
    from pyggml.models.context import Batch
    local = shared_model(alias)
    prompts = [local.tokenize(t) for t in ("The capital of France is", "Once upon a time", "1, 2, 3, 4,",
                                           "def main():", "Three colours:")]

    def steps(ctx) -> list:
        ctx.clear_cache()
        for i, p in enumerate(prompts[:4]):
            ctx.decode_batch(Batch.of(p[:-1], 0, seq=i))
        # the last prompt token of four sequences, and the whole prompt of a fifth
        parts = [(i, p[-1:], len(p) - 1) for i, p in enumerate(prompts[:4])] + [(4, prompts[4], 0)]
        batch = Batch(np.concatenate([t for _, t, _ in parts]).astype(np.int32),
                      np.concatenate([np.arange(p0, p0 + len(t)) for _, t, p0 in parts]).astype(np.int32),
                      np.concatenate([np.full(len(t), i) for i, t, _ in parts]).astype(np.int32),
                      np.concatenate([np.arange(len(t)) == len(t) - 1 for _, t, _ in parts]))
        top = ctx.decode_batch(batch, n_top=8, hist=np.tile(np.arange(3, dtype=np.int32), (5, 1)))
        pos = np.array([len(p) for p in prompts], np.int32)
        nxt = Batch(top.ids[:, 0].astype(np.int32), pos, np.arange(5, dtype=np.int32), np.ones(5, bool))
        rows = ctx.decode_batch(nxt)
        ctx.clear_cache()
        return [top.ids, top.values, top.hist_values, rows]

    want = steps(local.context)
    monkeypatch.setattr(context_module, "MIN_GROUP_TOKENS", 1)
    with pg.Model(alias, n_ctx=512, rpc=[s.endpoint for s in two_servers], progress=False) as m:
        ctx = m.context
        assert ctx.n_groups == 2  # one group per server
        ctx.n_groups = 4
        seq = np.array([0, 1, 2, 3, 4, 4, 4, 4], np.int32)
        assert ctx._pieces(Batch(seq, seq, seq, np.ones(8, bool))) == [(0, 2), (2, 4), (4, 8)]
        got = steps(ctx)
    for a, b in zip(got, want):
        assert a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("n_requests", [8, 3])
def test_concurrent_requests_pipelined_over_two_servers_equal_their_solo_answers(two_servers, monkeypatch,
                                                                                 n_requests):
    """The serving engine over two servers that hold half of the layers each: eight (or three)
    requests at once, decoding in two lanes that do not wait for each other (Engine._lane_step: one lane's
    step on a server while the other's is on the next), their prompts' steps cut into one group
    of sequences per server - every greedy answer is the one the model gives the request alone."""
    from pyggml.models import Engine
    from pyggml.models.context import Context

    from tests.models.test_engine import answers_from_threads
    prompts = ["The capital of France is", "Once upon a time there was", "def fib(n):", "Water is made of",
               "The best way to learn", "In 1969, the first", "My favourite fruit is", "Three colours:"][:n_requests]
    local = shared_model("smollm2")
    local.context.clear()
    want = {p: local.create_completion(p, max_tokens=10, temperature=0)["choices"][0]["text"] for p in prompts}
    cut = []
    pieces = Context._pieces

    def spy(self, batch):
        out = pieces(self, batch)
        cut.append(len(out))
        return out
    monkeypatch.setattr(Context, "_pieces", spy)
    with pg.Model("smollm2", n_ctx=1024, rpc=[s.endpoint for s in two_servers], progress=False) as m:
        assert set(m.model.placement.layers) == {0, 1} and m.context.n_groups == 2
        with Engine(m, n_parallel=8, n_batch=64) as engine:
            assert answers_from_threads(engine, prompts, 10) == want
            assert engine.stats.lane_steps >= 8  # (the lanes' steps: most of the 10 tokens of each)
    if n_requests == 8:
        assert max(cut) == 2  # steps of several sequences went through in two groups


def test_lanes_keep_each_answer_while_streams_end_join_and_sample(two_servers):
    """Lanes under churn: streams of different lengths end one after another (the lanes shrink
    and become uneven), one joins while the others generate (its prompt's step reads the lanes
    back first, then they start again), one samples with a seed, one is cancelled mid-stream -
    every other answer is the one the request gets alone."""
    from pyggml.models import Engine
    from pyggml.server.openai import submit
    asks = [("The capital of France is", 3, {}), ("Once upon a time there was", 9, {}),
            ("def fib(n):", 14, {"temperature": 0.8, "seed": 3}), ("Water is made of", 6, {}),
            ("My favourite fruit is", 11, {})]
    late = ("Three colours:", 8, {})
    local = shared_model("smollm2")
    local.context.clear()
    want = {p: local.create_completion(p, max_tokens=n, **({"temperature": 0} | kw))["choices"][0]["text"]
            for p, n, kw in asks + [late]}
    got: dict[str, str] = {}
    with pg.Model("smollm2", n_ctx=1024, rpc=[s.endpoint for s in two_servers], progress=False) as m:
        with Engine(m, n_parallel=8, n_batch=64) as engine:
            def ask(p: str, n: int, kw: dict) -> None:
                got[p] = "".join(c["choices"][0]["text"]
                                 for c in submit(engine, p, max_tokens=n, **({"temperature": 0} | kw)))

            def cancelled() -> None:
                stream = submit(engine, "A long story begins", max_tokens=40, temperature=0)
                for i, _ in enumerate(stream):
                    if i == 3:
                        stream.close()  # the client went away: its request is cancelled
                        return
            threads = [threading.Thread(target=ask, args=a) for a in asks] + [threading.Thread(target=cancelled)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 120
            while engine.stats.lane_steps < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            threads.append(threading.Thread(target=ask, args=late))
            threads[-1].start()
            for t in threads:
                t.join(300)
            assert engine.stats.lane_steps >= 4 and engine.busy_slots == 0
    assert got == want


def test_a_session_that_failed_sends_its_receiver_the_failure_not_stale_bytes(pair):
    """Three servers in a chain, the first killed: the middle one's wait failed (an error kept
    for its next reply), yet it went on and sent the tensor it computed from stale input to the
    last, which answered the step with no error - a wrong token.  A session with a failure kept
    now sends the failure over the link, and the receiver's step fails too."""
    x, y = RawClient(pair[0].endpoint), RawClient(pair[1].endpoint)
    token, _ = ok(y.call(C.PEER_TOKEN))
    body, _ = ok(x.call(C.PEER_CONNECT, P.PEER_CONNECT.pack(token), [pair[1].endpoint.encode()]))
    link = P.U32.unpack(body)[0]
    src = set_data(x, alloc(x), np.arange(16, dtype=np.float32), 0, (16, 1, 1, 1))
    dst = tensor(0, (16, 1, 1, 1), buffer=alloc(y), id=2)
    x.send_raw([P.HEADER.pack(C.WAIT_PEER, P.FLAG_NO_REPLY, 0, 3) + P.U32.pack(77)])  # no sender: it fails
    x.send_raw([P.HEADER.pack(C.COPY_TO_PEER, P.FLAG_NO_REPLY, 0, 4) + P.COPY_TO_PEER.pack(link, 5) + src + dst])
    y.send_raw([P.HEADER.pack(C.WAIT_PEER, P.FLAG_NO_REPLY, 0, 6) + P.U32.pack(5)])
    error(y.call(C.GET_TENSOR, dst + P.GET_TENSOR.pack(0, 64, P.Codec.RAW)), "the server sending this tensor failed")
    error(x.call(C.DEVICE_COUNT), "the server sending tensor 77 is gone")
    ok(y.call(C.DEVICE_COUNT))

"""Failover: kill -9 of an RPC server in the middle of a greedy generation; with
``failover`` the generation completes on the devices left (or a spare) and its tokens are
those of an uninterrupted run; without it, the clean error of today."""
from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest

import pyggml as pg
from pyggml.rpc import RPCError

from tests.conftest import shared_model

PROMPT = "Once upon a time, in a land far away,"


def uninterrupted(alias: str, n: int) -> list[int]:
    """The same generation without a failure, its prompt read in one call as the fresh model
    under test reads it (a prefix cached by an earlier test would be read in other pieces, and
    K-quant products round by the shape of the batch)."""
    m = shared_model(alias)
    m.context.clear()
    return list(m.generate(m.tokenize(PROMPT), max_tokens=n, temperature=0))


def generate_killing(m, server, at: int, max_tokens: int, caplog) -> list[int]:
    """``m``'s greedy tokens after PROMPT, ``server`` killed (kill -9) once token ``at`` is out;
    the warnings kept in ``caplog``."""
    got = []
    with caplog.at_level(logging.WARNING, logger="pyggml.models"):
        for i, token in enumerate(m.generate(m.tokenize(PROMPT), max_tokens=max_tokens, temperature=0)):
            got.append(token)
            if i == at:
                server.kill()
    return got


@pytest.mark.parametrize("alias, transport", [("smollm2", "tcp"), ("gemma3-270m", "tcp"), ("smollm2", "zmq")])
def test_greedy_generation_survives_a_killed_server(alias, transport, start_server, caplog):
    want = uninterrupted(alias, 32)
    servers = [start_server("--transport", transport), start_server("--transport", transport)]
    with pg.Model(alias, n_ctx=512, rpc=[s.endpoint for s in servers], progress=False, failover=True) as m:
        assert set(m.model.placement.layers) == {0, 1}
        assert generate_killing(m, servers[1], 8, 32, caplog) == want
        assert set(m.model.placement.layers) == {0}  # everything on the server left
        said = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
        assert len(said) == 1 and servers[1].endpoint in said[0] and "recovered in" in said[0]


def test_seeded_sampling_survives_a_killed_server(start_server):
    """The sampler's state lives with the generation, the logits are the same bits: a seeded
    draw after a failover is the uninterrupted run's."""
    m = shared_model("smollm2")
    m.context.clear()
    ids = m.tokenize(PROMPT)
    want = list(m.generate(ids, max_tokens=24, temperature=0.9, seed=7))
    servers = [start_server(), start_server()]
    with pg.Model("smollm2", n_ctx=512, rpc=[s.endpoint for s in servers], progress=False, failover=True) as r:
        got = []
        for i, token in enumerate(r.generate(ids, max_tokens=24, temperature=0.9, seed=7)):
            got.append(token)
            if i == 5:
                servers[0].kill()
        assert got == want and r.lost_endpoints == [servers[0].endpoint]


def test_a_spare_takes_the_lost_servers_place(start_server):
    want = uninterrupted("smollm2", 24)
    servers = [start_server(), start_server()]
    spare = start_server()
    with pg.Model("smollm2", n_ctx=512, rpc=[s.endpoint for s in servers], rpc_spare=spare.endpoint,
                  progress=False, failover=True) as m:
        got = []
        for i, token in enumerate(m.generate(m.tokenize(PROMPT), max_tokens=24, temperature=0)):
            got.append(token)
            if i == 4:
                servers[0].kill()
        assert got == want
        names = {m.model.devices[d].get_name() for d in m.model.placement.used()}
        assert f"RPC[{spare.endpoint}]" in names and f"RPC[{servers[0].endpoint}]" not in names
        lines = m.placement_lines()  # what the recovery's log line lists: the spare among them
        assert any(line.startswith(f"  RPC[{spare.endpoint}]: layers") for line in lines), lines
        assert not any(servers[0].endpoint in line for line in lines), lines


def test_a_server_that_comes_back_is_attached_again(start_server):
    want = uninterrupted("smollm2", 24)
    servers = [start_server(), start_server()]
    with pg.Model("smollm2", n_ctx=512, rpc=[s.endpoint for s in servers], progress=False, failover=True) as m:
        tokens = m.generate(m.tokenize(PROMPT), max_tokens=24, temperature=0)
        got = [next(tokens) for _ in range(6)]
        servers[1].kill()
        got += [next(tokens) for _ in range(6)]  # the failover happens here
        assert m.lost_endpoints == [servers[1].endpoint]
        back = start_server("-p", str(servers[1].port))
        assert m.reconnect() == [back.endpoint] and m.lost_endpoints == []
        assert {m.model.devices[d].get_name() for d in m.model.placement.used()} == {
            f"RPC[{servers[0].endpoint}]", f"RPC[{back.endpoint}]"}
        got += list(tokens)
        assert got == want


@pytest.mark.parametrize("killed", [0, 1])
def test_without_failover_a_killed_server_is_a_clean_error(start_server, killed):
    """The error names the server killed, whichever it is: the one that sends its activations
    to the other (which then reports it gone) or the one that receives them."""
    servers = [start_server(), start_server()]
    with pg.Model("smollm2", n_ctx=512, rpc=[s.endpoint for s in servers], progress=False) as m:
        t0 = time.monotonic()
        with pytest.raises(RPCError, match=servers[killed].endpoint):
            for i, _ in enumerate(m.generate(m.tokenize(PROMPT), max_tokens=32, temperature=0)):
                if i == 4:
                    servers[killed].kill()
        assert time.monotonic() - t0 < 30


def test_pyggml_chat_with_failover(start_server):
    """pyggml-chat -p with --failover: a server killed while the answer streams; the answer
    is the one a local run gives."""
    def chat(*extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "pyggml.cli.chat", "-m", "smollm2", "-p", "Tell me a story.",
                                 "-n", "48", "--temp", "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    local = chat()
    want, _ = local.communicate(timeout=120)
    servers = [start_server(), start_server()]
    p = chat("--rpc", ";".join(s.endpoint for s in servers), "--failover")
    first = b""
    deadline = time.monotonic() + 120
    while len(first) < 20 and time.monotonic() < deadline:  # the answer has begun
        if select.select([p.stdout], [], [], 1.0)[0]:
            first += os.read(p.stdout.fileno(), 4096)
    servers[1].kill()
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()
    assert first + rest == want
    assert b"lost" in err and servers[1].endpoint.encode() in err
    # the warning ends the answer's open line first (on stderr: the answer is left whole), and
    # the placement after it is on lines of its own, every server named
    assert b"\nWARNING pyggml.models: lost" in err, err.decode()
    assert f"\n  RPC[{servers[0].endpoint}]: layers 0-29, prolog, epilog".encode() in err, err.decode()


def test_a_second_loss_while_recovering_is_one_more_loss(start_server, monkeypatch, caplog):
    """Another server dies while the model is placed anew after a first loss: that round is
    given up, and the next places the model on what is left (here the one server alive), with
    the uninterrupted run's text."""
    want = uninterrupted("smollm2", 24)
    servers = [start_server(), start_server(), start_server()]
    rebuilds = []
    real = pg.Model.place_anew

    def rebuild_losing_another(self, history):
        rebuilds.append(1)
        if len(rebuilds) == 1:
            servers[2].kill()  # while the first recovery places the model anew
            servers[2].proc.wait()
        return real(self, history)
    monkeypatch.setattr(pg.Model, "place_anew", rebuild_losing_another)
    with pg.Model("smollm2", n_ctx=512, rpc=[s.endpoint for s in servers], progress=False, failover=True,
                  ngl="0:prolog,8;1:8;2:all") as m:
        assert generate_killing(m, servers[1], 5, 24, caplog) == want
        assert len(rebuilds) >= 2 and sorted(m.lost_endpoints) == sorted([servers[1].endpoint, servers[2].endpoint])
        assert any("lost while recovering" in r.getMessage() for r in caplog.records)
        assert {m.model.devices[d].get_name() for d in m.model.placement.used()} <= {f"RPC[{servers[0].endpoint}]",
                                                                                     "CPU"}


def test_the_cache_history_keeps_only_live_cells():
    """Recovery replays the batches that wrote the cells the cache holds now: a sequence's run
    of rows goes from a batch when its cells are freed, so the history grows with what is live,
    not with time; a run freed in part stays whole, followed by the seq_rm (its width decided
    its bits).  The replayed cache answers as the first does, bit for bit."""
    from pyggml.models.context import Batch
    m = pg.Model("smollm2", n_ctx=512, progress=False)
    try:
        ctx = m.context
        ctx.clear_cache()
        for seq in range(3):
            ctx.decode_batch(Batch.of(list(range(10 + seq, 30 + seq)), 0, seq=seq))
        for step in range(5):
            ctx.decode_batch(Batch(np.array([1, 2, 3], np.int32), np.full(3, 20 + step, np.int32),
                                   np.arange(3, dtype=np.int32), np.ones(3, bool)))
        ctx.seq_rm(1, 0)   # sequence 1 gone
        ctx.seq_rm(2, 22)  # sequence 2 from position 22 on: whole runs (its last 3 steps)
        rows = [(int(s), int(p)) for _, b in ctx.log for s, p in zip(b.seq, b.pos)]
        assert sorted(rows) == sorted([(0, p) for p in range(25)] + [(2, p) for p in range(22)])
        assert ctx.kv.n_used == len(rows)
        ctx.seq_rm(0, 10)  # sequence 0 from the middle of its prompt's run
        batches = [op[1] for op in ctx.log if op[0] == "b"]
        assert ctx.log[-1] == ("rm", 0, 10) and sum(len(b) for b in batches) == 20 + 22
        fresh = pg.Model("smollm2", n_ctx=512, progress=False)
        fresh.context.replay(ctx.log, [])
        assert fresh.context.kv.n_used == ctx.kv.n_used == 10 + 22
        probe = Batch(np.array([7, 7], np.int32), np.array([10, 22], np.int32), np.array([0, 2], np.int32),
                      np.ones(2, bool))
        assert np.array_equal(fresh.context.decode_batch(probe), ctx.decode_batch(probe))
        fresh.close()
    finally:
        m.close()


def test_a_copy_keeps_what_it_read_in_the_history_and_goes_with_its_cells():
    """A copy of cells between sequences (Context.seq_cp) is in the history: the batch that
    wrote what it read stays after its own sequence lets those cells go (a replay writes them
    again, then copies them); once the copied cells are freed too, the copy leaves the history,
    and the donor's batch at its sequence's next seq_rm (a slot taken again) - a donor's
    batches do not stay for ever.  The replayed cache answers as the first does, bit for bit."""
    from pyggml.models.context import Batch
    m = pg.Model("smollm2", n_ctx=512, progress=False)
    fresh = pg.Model("smollm2", n_ctx=512, progress=False)
    try:
        ctx = m.context
        ctx.clear_cache()
        ctx.decode_batch(Batch.of(list(range(10, 50)), 0, seq=3))  # the donor's prompt
        ctx.decode_batch(Batch.of(list(range(60, 80)), 0, seq=7))  # another sequence, alive throughout
        assert ctx.seq_cp(3, 5, 0, 24)
        ctx.decode_batch(Batch.of(list(range(90, 106)), 24, seq=5))
        ctx.seq_rm(3, 0)  # the donor lets go: its batch stays, for the copy
        assert ("cp", 3, 5, 0, 24) in ctx.log and any(op[0] == "b" and (op[1].seq == 3).all() for op in ctx.log)
        fresh.context.replay(ctx.log, [])
        probe = Batch(np.array([7, 7], np.int32), np.array([40, 20], np.int32), np.array([5, 7], np.int32),
                      np.ones(2, bool))
        assert np.array_equal(fresh.context.decode_batch(probe), ctx.decode_batch(probe))
        ctx.seq_rm(5, 0)  # the copied cells go too: the copy with them
        assert not any(op[0] == "cp" for op in ctx.log)
        assert {int(s) for op in ctx.log if op[0] == "b" for s in op[1].seq} == {3, 7}
        ctx.seq_rm(3, 0)  # the donor's slot taken again (Scheduler.admit): now nothing reads its batch
        assert {int(s) for op in ctx.log if op[0] == "b" for s in op[1].seq} == {7}
    finally:
        fresh.close()
        m.close()

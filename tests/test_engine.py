"""The batching engine and the unified KV cache under it: a sequence decoded beside others
gets its solo bits, requests from threads get their solo greedy answers, cells run out
gracefully, abandoned streams free their slots."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import pyggml as pg
from pyggml.models import Engine
from pyggml.models.context import Batch
from pyggml.models.engine import QueueFullError

from .conftest import shared_model

PROMPTS = ["The capital of France is", "Once upon a time there was", "def fib(n):", "Water is made of"]


def same(got: np.ndarray, want: np.ndarray, exact: bool) -> bool:
    return np.array_equal(got, want) if exact else int(np.argmax(got)) == int(np.argmax(want))


def test_a_sequence_in_a_batch_of_four_gets_its_solo_logits():
    """Four prompts read in one batch, then four decode steps of one token per sequence:
    every row's logits are the bits of the same sequence decoded alone (SmolLM2, Q4_1).

    Not so for Gemma 3's file, which holds K-quants: llama.cpp computes their products by
    another kernel when a batch has enough columns (the repacked Q4_K gemm for whole fours
    of columns, the tiled Q5_K/Q6_K kernels from 8), with other rounding, so a row's bits
    depend on the batch around it there, as they do in llama.cpp (models/engine.py)."""
    m = shared_model("smollm2")
    ctx = m.context
    exact = True
    prompts = [m.tokenize(t) for t in PROMPTS]
    solo = []
    for p in prompts:
        ctx.clear()
        rows, toks = [ctx.decode(p)[-1]], list(p)
        for _ in range(4):
            toks.append(int(np.argmax(rows[-1])))
            rows.append(ctx.decode([toks[-1]])[-1])
        solo.append((rows, toks))
    ctx.clear()
    ctx.kv.clear()
    try:
        batch = Batch(np.concatenate([np.array(p, np.int32) for p in prompts]),
                      np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts]),
                      np.concatenate([np.full(len(p), i, np.int32) for i, p in enumerate(prompts)]),
                      np.concatenate([np.arange(len(p)) == len(p) - 1 for p in prompts]))
        got = ctx.decode_batch(batch)
        for i in range(4):
            assert same(got[i], solo[i][0][0], exact), f"prompt {i}"
        for k in range(4):
            step = Batch(np.array([solo[i][1][len(prompts[i]) + k] for i in range(4)], np.int32),
                         np.array([len(p) + k for p in prompts], np.int32), np.arange(4, dtype=np.int32),
                         np.ones(4, bool))
            got = ctx.decode_batch(step)
            for i in range(4):
                assert same(got[i], solo[i][0][k + 1], exact), f"step {k}, sequence {i}"
        assert ctx.kv.n_used == sum(len(p) + 4 for p in prompts)
    finally:
        ctx.kv.clear()


def test_sequences_do_not_see_each_other():
    """A sequence's logits do not change when another sequence's cells are rewritten."""
    m = shared_model("smollm2")
    ctx = m.context
    ctx.clear()
    ctx.kv.clear()
    try:
        a, b = m.tokenize("The capital of France is"), m.tokenize("Completely different words here")
        ctx.decode_batch(Batch.of(a, 0, seq=3))
        ctx.decode_batch(Batch.of(b, 0, seq=5))
        first = ctx.decode_batch(Batch.of([11], len(a), seq=3))[0]
        ctx.kv.seq_rm(3, len(a))
        ctx.kv.seq_rm(5, 0)
        ctx.decode_batch(Batch.of(m.tokenize("Other text entirely, longer than before"), 0, seq=5))
        assert np.array_equal(ctx.decode_batch(Batch.of([11], len(a), seq=3))[0], first)
    finally:
        ctx.kv.clear()


@pytest.fixture(scope="module")
def small():
    """SmolLM2 with a 256-cell cache (four pages): room runs out quickly."""
    with pg.Model("smollm2", n_ctx=256, progress=False) as m:
        yield m


def test_engine_from_threads_equals_the_model_alone(small):
    want = {p: small.create_completion(p, max_tokens=12, temperature=0)["choices"][0]["text"] for p in PROMPTS}
    with Engine(small, n_parallel=4, n_batch=64) as engine:
        with pytest.raises(RuntimeError, match="belongs to the Engine"):
            small.create_completion("x", max_tokens=1)
        out: dict[str, str] = {}

        def ask(p):
            out[p] = "".join(c["choices"][0]["text"] for c in engine.submit(p, max_tokens=12, temperature=0))
        threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert out == want
        r = engine.submit(PROMPTS[0], stream=False, max_tokens=12, temperature=0)
        assert r["choices"][0]["text"] == want[PROMPTS[0]]
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(small.tokenize(PROMPTS[0])) - 1
    assert small.create_completion(PROMPTS[1], max_tokens=12, temperature=0)["choices"][0]["text"] == want[PROMPTS[1]]


def test_full_cache_ends_with_length_and_frees_cells(small):
    """Two sequences that want more than the 256 cells: each ends with "length" when its
    next cell is missing, nothing hangs, and the cache serves the next request."""
    with Engine(small, n_parallel=2, n_batch=64) as engine:
        results = []

        def ask(p):
            results.append(engine.submit(p, stream=False, max_tokens=400, temperature=0))
        threads = [threading.Thread(target=ask, args=(p,)) for p in ("1, 2, 3, 4, 5, 6,", "10, 20, 30, 40,")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(results) == 2
        for r in results:
            assert r["choices"][0]["finish_reason"] in ("length", "stop")
        assert sum(r["usage"]["total_tokens"] for r in results) <= 256 + 2
        assert any(r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] < 400
                   for r in results)
        r = engine.submit(PROMPTS[2], stream=False, max_tokens=4, temperature=0)
        assert r["usage"]["completion_tokens"] == 4
        with pytest.raises(ValueError, match="more than the context"):
            engine.submit(list(range(1, 300)), stream=False)


def test_abandoned_stream_frees_its_slot_and_full_queue_refuses(small):
    with Engine(small, n_parallel=1, n_batch=64, max_queue=1) as engine:
        stream = engine.submit(PROMPTS[0], max_tokens=200, temperature=0)
        next(stream)
        done = []
        waiting = threading.Thread(target=lambda: done.append(
            engine.submit(PROMPTS[1], stream=False, max_tokens=3, temperature=0)))
        waiting.start()
        for _ in range(200):
            if engine.queued:
                break
            threading.Event().wait(0.01)
        with pytest.raises(QueueFullError):
            engine.submit(PROMPTS[2], max_tokens=2)
        stream.close()
        waiting.join(60)
        assert done and done[0]["usage"]["completion_tokens"] == 3
        assert engine.busy_slots == 0 and engine.stats.requests == 2

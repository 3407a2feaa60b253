"""The batching engine and the unified KV cache under it: a sequence decoded beside others
gets its solo bits, requests from threads get their solo greedy answers, cells run out
gracefully, abandoned streams free their slots."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyggml as pg
from pyggml.models import Engine
from pyggml.cpu.blockdot import column_format
from pyggml.cpu.kinds import Fmt
from pyggml.batch_rules import BATCH_RULES, COLUMNWISE_RULES
from pyggml.models.context import Batch
from pyggml.models.engine import QueueFullError
from pyggml.server.openai import submit

from tests.conftest import shared_model


PROMPTS = ["The capital of France is", "Once upon a time there was", "def fib(n):", "Water is made of"]


def same(got: np.ndarray, want: np.ndarray, exact: bool) -> bool:
    return np.array_equal(got, want) if exact else int(np.argmax(got)) == int(np.argmax(want))


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_a_sequence_in_a_batch_of_four_gets_its_solo_logits(alias):
    """Four prompts read in one batch, then four decode steps of one token per sequence:
    every row's logits are the bits of the same sequence decoded alone - SmolLM2's Q4_1 and
    Gemma 3's K-quants alike: llama.cpp computes the K-quants by other kernels when a batch
    has enough columns (the repacked Q4_K gemm for whole fours of columns, the tiled Q5_K/Q6_K
    kernels from 8), and the batch's products compute each sequence's run of columns as that
    sequence alone would (ops.mul_mat's runs)."""
    m = shared_model(alias)
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


def answers_from_threads(engine: Engine, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy streamed answer, all asked at once from threads of their own."""
    out: dict[str, str] = {}

    def ask(p):
        out[p] = "".join(c["choices"][0]["text"] for c in submit(engine, p, max_tokens=max_tokens, temperature=0))
    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_engine_from_threads_equals_the_model_alone(small):
    want = {p: small.create_completion(p, max_tokens=12, temperature=0)["choices"][0]["text"] for p in PROMPTS}
    with Engine(small, n_parallel=4, n_batch=64) as engine:
        with pytest.raises(RuntimeError, match="belongs to the Engine"):
            small.create_completion("x", max_tokens=1)
        assert answers_from_threads(engine, PROMPTS, 12) == want
        r = submit(engine, PROMPTS[0], stream=False, max_tokens=12, temperature=0)
        assert r["choices"][0]["text"] == want[PROMPTS[0]]
        # the slot still holds this prompt and the output its read gave: nothing is read again
        # (re-reading only its last token would take the attention's single-token path, not a
        # fresh read's: reusable_prefix would read the last two again)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 5
    assert small.create_completion(PROMPTS[1], max_tokens=12, temperature=0)["choices"][0]["text"] == want[PROMPTS[1]]


def test_decoding_steps_find_their_graphs_built_ahead(small):
    """The stalls: a stream that joins or leaves changes the decoding step's shape, and a graph
    built on the step loop stops every stream in the step for tens of ms.  The engine builds the
    decoding steps' shapes while idle (1 .. n_parallel streams, greedy and default sampling),
    so that no step that reads no prompt builds a graph (prompts: the test below)."""
    with Engine(small, n_parallel=3, n_batch=64) as engine:
        assert engine.wait_built_ahead(timeout=120) and engine.warming == 0
        # the largest step, then 1..3 streams and steps that read prompts (padded to 8, 16, 24,
        # 32, 48 or 64 tokens: Context.padding), greedy and sampled; and the copy of a page of
        # cells from a slot to another (Context.seq_cp)
        from pyggml.models.engine import COPY_SHAPE
        *shapes, copy = engine._warm_shapes()
        assert engine.ctx.padding.tokens == (8, 16, 24, 32, 48, 64)
        assert len(shapes) == 1 + 2 * (3 + 6) and all(engine.ctx.has_graph(s) for s in shapes)
        assert copy == (COPY_SHAPE, 64) and not engine.ctx.prepare_copy(64)  # (kept: not built again)

        def ask(prompt: str, n: int, **sampling) -> None:
            list(submit(engine, prompt, max_tokens=n, **sampling))
        # three streams that end one after another (3, 2, then 1 generating), one of them sampled
        threads = [threading.Thread(target=ask, args=(p, n), kwargs=kw) for p, n, kw in
                   [(PROMPTS[0], 4, {"temperature": 0}), (PROMPTS[1], 9, {"temperature": 0}),
                    (PROMPTS[2], 14, {"temperature": 0.8, "seed": 1})]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        st = engine.stats
        assert st.generated_tokens > 20
        assert st.graph_builds_decoding == 0, st
        assert sum(st.step_buckets) == st.steps and st.slowest_step > 0


def test_output_rows_are_padded_less_where_the_head_is_most_of_the_model():
    """A step that reads prompts pads its output rows (Context.padding): to 8 for SmolLM2, whose
    head row costs a quarter of a token through its layers; from 2 by powers of two for Gemma
    3, whose 262144-row head costs 1.7 tokens a row - padding a stream's step with a prompt's
    last token to 8 rows of it took a third more time than the step.  Every count is built
    ahead (Engine._warm_shapes)."""
    from pyggml.models.context import Padding
    shares = {alias: shared_model(alias).model.hp.head_share for alias in ("smollm2", "gemma3-270m")}
    assert 0.2 < shares["smollm2"] < 0.5 < 1.5 < shares["gemma3-270m"] < 2
    small = Padding.for_server(128, 8, 40, shares["smollm2"])
    assert small.min_outputs == 8 and small.output_counts(8) == [8]
    large = Padding.for_server(128, 8, 40, shares["gemma3-270m"])
    assert large.min_outputs == 2 and large.output_counts(8) == [2, 4, 8] and large.outputs(3) == 4
    assert Padding.for_server(128, 1, 40, 9.0).output_counts(1) == [1]


JOINING = {"padded": ["Write two sentences about the moon and the tides of the sea",
                      "List three colours of"],
           "beside": ["The three largest planets of the solar system are Jupiter, Saturn and",
                      "A recipe for bread needs flour, water, salt and"],
           "built": ["Rivers flow from", "In the morning the market"]}  # (other lengths: graphs not kept yet)


def joining_running_stream(engine: Engine, prompts: list[str]) -> dict[str, str]:
    """A greedy stream of 24 tokens, and once it generates, two prompts of lengths the engine
    has no graph for joining it: every answer's text."""
    out: dict[str, str] = {}
    generating = threading.Event()

    def ask(prompt: str, n: int) -> None:
        text = ""
        for chunk in submit(engine, prompt, max_tokens=n, temperature=0):
            text += chunk["choices"][0]["text"]
            generating.set()
        out[prompt] = text
    first = threading.Thread(target=ask, args=(LONG, 24))
    first.start()
    assert generating.wait(120)
    joining = [threading.Thread(target=ask, args=(p, 6)) for p in prompts]
    for t in joining:
        t.start()
    for t in [first, *joining]:
        t.join(300)
    return out


@pytest.mark.parametrize("case", ["padded", "beside", "built"])
def test_prompts_joining_running_streams_never_stall_them_for_a_graph(small, case, monkeypatch):
    """The stalls: a prompt that joins generating streams needs a graph of its length beside
    theirs, and building and planning one takes several decoding steps' time.

    - ``padded`` (the engine's way): the steps that read prompts are padded to a few shapes,
      built while the engine was idle (Context.padding), so the prompts are read at once and
      no step builds a graph, with no deferral allowed;
    - ``beside``: unpadded, the engine leaves the prompts for later and prepares one part of
      their graph per step of the streams (Engine._prepare_beside);
    - ``built``: unpadded with no deferral allowed (MAX_DEFERRED_STEPS 0), the steps build
      them, and the counter says so.

    In every case the answers are those of the model alone: padding changes no bit."""
    from pyggml.models import engine as engine_module
    monkeypatch.setattr(engine_module, "MAX_DEFERRED_STEPS", 8 if case == "beside" else 0)
    monkeypatch.setattr(engine_module, "PAD_PROMPT_SHAPES", case == "padded")
    want = {p: small.create_completion(p, max_tokens=n, temperature=0)["choices"][0]["text"]
            for p, n in [(LONG, 24), *((p, 6) for p in JOINING[case])]}
    with Engine(small, n_parallel=3, n_batch=64) as engine:
        assert engine.wait_built_ahead(timeout=120)
        assert joining_running_stream(engine, JOINING[case]) == want
        st = engine.stats
    if case == "padded":
        assert st.mixed_steps >= 1 and st.graph_builds == 0 and st.graph_parts_beside == 0, st
    elif case == "beside":
        assert st.graph_builds_streaming == 0, st
        assert st.graph_parts_beside >= 2, st  # (a build, then the split, allocation and plan)
    else:
        assert st.graph_builds_streaming >= 1 and st.graph_parts_beside == 0, st


def test_requests_arriving_together_at_an_idle_engine_are_read_together(small, monkeypatch):
    """A burst of clients: an idle engine waits while requests keep arriving (each within
    ADMIT_QUIET_S of the last), so that their prompts are read in the first steps and no stream
    waits for another's prompt; a request that comes later is read beside the streams."""
    from pyggml.models import engine as engine_module
    monkeypatch.setattr(engine_module, "ADMIT_QUIET_S", 0.5)  # (generous: a loaded machine's threads)
    monkeypatch.setattr(engine_module, "ADMIT_WINDOW_S", 3.0)
    with Engine(small, n_parallel=3, n_batch=64) as engine:
        assert engine.wait_built_ahead(timeout=120)
        out: dict[str, str] = {}

        def ask(p: str, n: int) -> None:
            out[p] = "".join(c["choices"][0]["text"] for c in submit(engine, p, max_tokens=n, temperature=0))
        threads = [threading.Thread(target=ask, args=(p, 6)) for p in PROMPTS[:3]]
        for t in threads:
            t.start()
            time.sleep(0.02)
        for t in threads:
            t.join(300)
        assert len(out) == 3 and engine.stats.mixed_steps == 0, engine.stats
        base = engine.stats.generated_tokens
        streaming = threading.Thread(target=ask, args=(LONG, 16))
        streaming.start()
        deadline = time.monotonic() + 120
        while engine.stats.generated_tokens < base + 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        ask(PROMPTS[3], 2)  # joins a generating stream
        streaming.join(300)
        assert engine.stats.mixed_steps >= 1


def test_a_prompt_read_whole_before_is_answered_from_its_stored_row(small):
    """A request whose prompt a slot read whole, and still holds, draws its first token from the
    row that read gave (runner.PromptAnswer): no token is read again, every prompt token counts
    as cached, and the answer is the model's alone - greedy, and sampled with a seed.  Another
    sampling that watches tokens the stored row lacks (a bias on a token outside its top)
    reads the prompt's tail again, as before."""
    prompt = "The history of the printing press begins in"
    greedy = small.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    sampled = small.create_completion(prompt, max_tokens=8, temperature=0.9, seed=5)["choices"][0]["text"]
    n_ids = len(small.tokenize(prompt))
    with Engine(small, n_parallel=2, n_batch=64) as engine:
        first = submit(engine, prompt, stream=False, max_tokens=8, temperature=0)
        read = engine.stats.prompt_tokens
        again = submit(engine, prompt, stream=False, max_tokens=8, temperature=0)
        assert first["choices"][0]["text"] == again["choices"][0]["text"] == greedy
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n_ids
        assert engine.stats.prompt_tokens == read and engine.stats.prompts_answered == 1
        # the stored row is the greedy request's top: a sampler with a top of 40 needs more
        r = submit(engine, prompt, stream=False, max_tokens=8, temperature=0.9, seed=5)
        assert r["choices"][0]["text"] == sampled and engine.stats.prompts_answered == 1
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] < n_ids
        # that read stored its own (larger) top: the same sampling again is answered from it
        r = submit(engine, prompt, stream=False, max_tokens=8, temperature=0.9, seed=5)
        assert r["choices"][0]["text"] == sampled and engine.stats.prompts_answered == 2
        # a bias on a token the stored row does not hold: read again, and the bias applies
        far = 40000  # (a token far from this prompt's top 8)
        r = submit(engine, prompt, stream=False, max_tokens=1, temperature=0, logit_bias={str(far): 100})
        assert engine.stats.prompts_answered == 2 and small.detokenize([far]) == r["choices"][0]["text"]


LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from those used for wine. Within fifty years "
        "printers worked in more than two hundred cities, and the price of a book fell so far that students, "
        "merchants and craftsmen could own the texts their parents had only heard read aloud in churches, and")


def test_k_quant_answers_in_a_busy_engine_are_the_models_alone():
    """Gemma 3's K-quants, whose batch kernels round otherwise: prompts of 6 to ~70 tokens read
    in pieces of at most 32 tokens beside each other's decoding, then a follow-up that reuses a
    slot's cached prefix - every greedy answer is Model.create_completion's, token for token."""
    prompts = [PROMPTS[1], LONG, PROMPTS[3], LONG[:200]]
    follow_up = LONG + " the first newspapers"
    with pg.Model("gemma3-270m", n_ctx=1024, progress=False) as m:
        want = {p: m.create_completion(p, max_tokens=16, temperature=0)["choices"][0]["text"]
                for p in [*prompts, follow_up]}
        assert len(m.tokenize(LONG)) > 64 and len(m.tokenize(prompts[3])) > 32
        with Engine(m, n_parallel=4, n_batch=32) as engine:
            assert answers_from_threads(engine, prompts, 16) == {p: want[p] for p in prompts}
            r = submit(engine, follow_up, stream=False, max_tokens=16, temperature=0)
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 32
            assert r["choices"][0]["text"] == want[follow_up]


def test_full_cache_ends_with_length_and_frees_cells(small):
    """Two sequences that want more than the 256 cells: each ends with "length" when its
    next cell is missing, nothing hangs, and the cache serves the next request."""
    with Engine(small, n_parallel=2, n_batch=64) as engine:
        results = []

        def ask(p):
            results.append(submit(engine, p, stream=False, max_tokens=400, temperature=0))
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
        r = submit(engine, PROMPTS[2], stream=False, max_tokens=4, temperature=0)
        assert r["usage"]["completion_tokens"] == 4
        with pytest.raises(ValueError, match="more than the context"):
            submit(engine, list(range(1, 300)), stream=False)
        with pytest.raises(ValueError, match="more than the context"):  # (it waited at the queue's head for ever)
            submit(engine, list(range(1, engine.n_ctx + 1)), stream=False)


def test_abandoned_stream_frees_its_slot_and_full_queue_refuses(small):
    with Engine(small, n_parallel=1, n_batch=64, max_queue=1) as engine:
        stream = submit(engine, PROMPTS[0], max_tokens=200, temperature=0)
        next(stream)
        done = []
        waiting = threading.Thread(target=lambda: done.append(
            submit(engine, PROMPTS[1], stream=False, max_tokens=3, temperature=0)))
        waiting.start()
        for _ in range(200):
            if engine.queued:
                break
            threading.Event().wait(0.01)
        with pytest.raises(QueueFullError):
            submit(engine, PROMPTS[2], max_tokens=2)
        stream.close()
        waiting.join(60)
        assert done and done[0]["usage"]["completion_tokens"] == 3
        assert engine.busy_slots == 0 and engine.stats.requests == 2


def kernels_of(pieces: list[tuple[int, int]]) -> dict[int, tuple]:
    """What decides each position's arithmetic when a prompt is read in ``pieces``: its format
    in repacked Q4_K and in Q6_K products (blockdot.column_format, the kernels' own rule) and
    whether its piece is a single token (the attention's single-token path)."""
    fmt = column_format.py_func
    return {p: (fmt(Fmt.Q4_K_X8, p - s, e - s, 8), fmt(Fmt.Q6_K, p - s, e - s, 8), e - s == 1)
            for s, e in pieces for p in range(s, e)}


def read_after_cache(rules, total: int, ubatch: int, cached: int, budgets: list[int]) -> tuple[int, list]:
    """Where the engine starts a ``total``-token prompt of which ``cached`` tokens are in a
    slot's cells, and the pieces it reads the rest in, each step's budget the next of
    ``budgets`` (BatchRules.reusable_prefix, prompt_cut)."""
    start = rules.reusable_prefix(cached, total, ubatch)
    assert 0 <= start <= min(cached, total - 1)
    pieces, done = [], start
    for step in range(total + 1):
        if done == total:
            break
        budget = budgets[step % len(budgets)]
        n = rules.prompt_cut(done, total, budget, ubatch)
        assert 0 < n <= budget
        pieces.append((done, done + n))
        done += n
    return start, pieces


def whole_read(total: int, ubatch: int) -> list[tuple[int, int]]:
    return [(s, min(s + ubatch, total)) for s in range(0, total, ubatch)]


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 700), ubatch=st.sampled_from([16, 64, 256]), cached=st.integers(0, 700),
       budgets=st.lists(st.integers(BATCH_RULES.min_budget, 300), min_size=1, max_size=40))
def test_a_prompt_read_in_pieces_gets_the_kernels_of_a_whole_read(total, ubatch, cached, budgets):
    """The engine reads a prompt in pieces that fit each step's budget, after whatever prefix a
    slot has cached; every token must still meet the kernels it meets when the prompt is read
    whole in ubatches (Context.decode), or its bits - and a greedy answer - would depend on
    what ran beside it."""
    start, pieces = read_after_cache(BATCH_RULES, total, ubatch, cached, budgets)
    whole, got = kernels_of(whole_read(total, ubatch)), kernels_of(pieces)
    assert all(got[p] == whole[p] for p in range(start, total))


def kernels_columnwise(pieces: list[tuple[int, int]]) -> dict[int, bool]:
    """What decides a position's arithmetic where every product computes its columns alike
    (kinds.COLUMNWISE: SmolLM2's Q4_1): whether its piece is a single token only."""
    return {p: e - s == 1 for s, e in pieces for p in range(s, e)}


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 700), ubatch=st.sampled_from([16, 64, 256]), cached=st.integers(0, 700),
       budgets=st.lists(st.integers(COLUMNWISE_RULES.min_budget, 300), min_size=1, max_size=40))
def test_columnwise_weights_let_a_prompt_be_cut_anywhere_but_one_token_alone(total, ubatch, cached, budgets):
    """Where no product tiles its columns, a prompt's pieces may start and end anywhere: a
    cached prefix is reused but for at most one token, and no token of a longer ubatch is ever
    read alone (the attention's single-token path)."""
    start, pieces = read_after_cache(COLUMNWISE_RULES, total, ubatch, cached, budgets)
    assert start >= min(cached, total - 1) - 1  # all that is cached, but a token to read beside the last
    whole, got = kernels_columnwise(whole_read(total, ubatch)), kernels_columnwise(pieces)
    assert all(got[p] == whole[p] for p in range(start, total))


def test_a_models_rules_follow_its_layers_weights():
    """SmolLM2's layers are Q4_1: its prompts may be cut anywhere but one token alone; Gemma 3's
    hold K-quants, tiled from 8 columns: pieces in eights (the head, which multiplies only the
    outputs, does not count)."""
    assert shared_model("smollm2").context.rules == COLUMNWISE_RULES
    assert shared_model("gemma3-270m").context.rules == BATCH_RULES
    assert BATCH_RULES.joined(COLUMNWISE_RULES) == BATCH_RULES == COLUMNWISE_RULES.joined(BATCH_RULES)


SYSTEM = "You are a careful assistant for a lighthouse museum. Answer in one short sentence, plainly."
QUESTIONS = ["Who kept the light?", "What is a lens?", "Why paint it red?", "When was it built?"]


def test_a_prompt_sharing_another_slots_prefix_is_read_after_a_copy_of_its_cells(small):
    """A prompt that shares a prefix (a system prompt) with another slot's cells - that slot
    idle, keeping its own prompt, or generating - takes an empty slot and starts from a copy of
    those cells (Context.seq_cp: llama-server's unified cache shares them the same way), then
    reads the rest: its answer is the model's alone, and the copied tokens count as cached."""
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    want = [small.create_chat_completion(c, max_tokens=n, temperature=0)["choices"][0]["message"]["content"]
            for c, n in zip(chats, (6, 6, 24, 6))]
    with Engine(small, n_parallel=3, n_batch=64) as engine:
        def ask(i: int, n: int) -> dict:
            return submit(engine, messages=chats[i], stream=False, max_tokens=n, temperature=0)
        first = ask(0, 6)
        assert first["choices"][0]["message"]["content"] == want[0] and engine.stats.copied_tokens == 0
        second = ask(1, 6)  # the first's slot is idle, and keeps its prompt
        copied = engine.stats.copied_tokens
        assert second["choices"][0]["message"]["content"] == want[1]
        assert copied >= 16 and second["usage"]["prompt_tokens_details"]["cached_tokens"] == copied
        assert ask(0, 6)["choices"][0]["message"]["content"] == want[0]  # (still there, answered)

        out = {}
        generating = threading.Event()

        def stream(i: int, n: int) -> None:
            text = ""
            for chunk in submit(engine, messages=chats[i], max_tokens=n, temperature=0):
                text += chunk["choices"][0]["delta"].get("content", "")
                generating.set()
            out[i] = text
        t = threading.Thread(target=stream, args=(2, 24))
        t.start()
        assert generating.wait(120)
        out[3] = ask(3, 6)["choices"][0]["message"]["content"]  # beside a stream
        t.join(300)
        assert [out[2], out[3]] == want[2:] and engine.stats.copied_tokens > copied


@pytest.mark.parametrize("budget, other", [(None, PROMPTS[1]), (16, LONG), (16, PROMPTS[1])])
def test_a_request_answered_from_its_row_waits_for_a_burst_beyond_the_prompt_budget(small, monkeypatch,
                                                                                   budget, other):
    """Requests admitted together: one answered from its stored row takes its first token once
    the prompt admitted with it is read - no step reads a prompt beside a generating stream, as
    in a burst read in one batch - unless that prompt fits the prompt budget (--prompt-chunk):
    then it is answered at once and the prompt read beside its stream, a stop of one chunk, as
    when that prompt comes a moment later.  The answers are the model's alone either way."""
    from pyggml.models import engine as engine_module
    monkeypatch.setattr(engine_module, "ADMIT_QUIET_S", 0.5)  # (generous: a loaded machine's threads)
    monkeypatch.setattr(engine_module, "ADMIT_WINDOW_S", 3.0)
    want = {p: small.create_completion(p, max_tokens=6, temperature=0)["choices"][0]["text"]
            for p in (PROMPTS[0], other)}
    with Engine(small, n_parallel=3, n_batch=64, prompt_budget=budget) as engine:
        out: dict[str, str] = {}

        def ask(p: str) -> None:
            out[p] = "".join(c["choices"][0]["text"] for c in submit(engine, p, max_tokens=6, temperature=0))
        ask(PROMPTS[0])  # read whole: its slot keeps the answer
        threads = [threading.Thread(target=ask, args=(p,)) for p in (other, PROMPTS[0])]
        for t in threads:  # the new prompt first, so that the engine gathers the two
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(300)
        st = engine.stats
    assert out == want
    fits = budget is not None and len(small.tokenize(other)) <= budget
    assert st.prompts_answered == 1 and (st.mixed_steps >= 1 if fits else st.mixed_steps == 0), st

"""Real models against llama.cpp's reference outputs, and the behaviour of the runtime."""
from __future__ import annotations

import numpy as np
import pytest

from pyggml.models import Context, ContextFullError, UnsupportedArchitecture, load_model

from tests.conftest import REFERENCES, reference, shared_model

# The CPU backend does ggml's arithmetic operation for operation (pyggml/cpu/simd.py, qdot.py,
# nn.py), so our logits equal llama.cpp's: every argmax agrees and the log-probabilities match
# to the precision the reference file prints.  The targets are checked as stated (99%
# argmax, 0.5% NLL) and the closeness more tightly, so that a lost bit of exactness shows.
MIN_ARGMAX_AGREEMENT = 0.99


def _logsumexp(z: np.ndarray) -> np.ndarray:
    top = z.max(axis=-1)
    return top + np.log(np.exp(z - top[..., None]).sum(axis=-1))


@pytest.mark.parametrize("alias", list(REFERENCES))
def test_teacher_forced_logits_agree_with_llama_cpp(alias):
    m, ref = shared_model(alias), reference(alias)
    agree = total = 0
    top_diffs = []
    for p in ref["prompts"]:
        logits = m.logits(p["tokens"])
        assert logits.shape == (len(p["tokens"]), m.n_vocab) and logits.dtype == np.float32
        ours_lp = logits - _logsumexp(logits)[:, None]
        for i, (ids, vals, lse) in enumerate(zip(p["top_ids"], p["top_logits"], p["logsumexp"])):
            theirs = np.asarray(vals) - lse
            top_diffs.append(np.abs(ours_lp[i, ids[:5]] - theirs[:5]))
        agree += int((logits.argmax(1) == [ids[0] for ids in p["top_ids"]]).sum())
        total += len(p["tokens"])
    text = ref["text"]
    logits = m.logits(text["tokens"])
    agree += int((logits.argmax(1) == np.asarray(text["argmax"])).sum())
    total += len(text["tokens"])
    targets = np.asarray(text["tokens"][1:])
    nll = (_logsumexp(logits[:-1]) - logits[np.arange(len(targets)), targets]).mean()
    diffs = np.concatenate(top_diffs)
    print(f"{alias}: argmax agreement {agree}/{total}, mean NLL {nll:.5f} vs {text['mean_nll']:.5f}, "
          f"top-5 log-prob |diff| mean {diffs.mean():.4f} max {diffs.max():.4f}")
    assert abs(nll - text["mean_nll"]) / text["mean_nll"] < 0.005
    assert agree / total >= MIN_ARGMAX_AGREEMENT
    assert diffs.mean() < 1e-3 and diffs.max() < 1e-2


@pytest.mark.parametrize("alias", list(REFERENCES))
def test_greedy_continuations(alias):
    m, ref = shared_model(alias), reference(alias)
    same = 0
    for p in ref["prompts"]:
        # llama.cpp evaluated each prompt as one batch; a prefix cached from another prompt was
        # computed in a batch of another size, and ggml's kernels for a batch depend on its size
        m.context.clear()
        out = list(m.generate(p["tokens"], max_tokens=16, temperature=0))
        assert len(out) == 16 or m.finish_reason == "stop"
        matched = next((i for i, (a, b) in enumerate(zip(out, p["greedy"])) if a != b), 16)
        print(f"{alias} {p['prompt']!r}: first {matched} tokens equal")
        same += matched == 16
    assert same == len(ref["prompts"])  # the issue asks for 3 of the 4; llama.cpp's arithmetic gives all


def test_incremental_decoding_matches_the_batch(any_model):
    """Logits token by token through the KV cache equal the teacher-forced batch."""
    m = any_model
    ids = m.tokenize("The quick brown fox jumps over the lazy dog because")
    batch = m.logits(ids)
    ctx = m.context
    ctx.clear()
    steps = [ctx.decode(ids[:3])[-1]] + [ctx.decode([t])[-1] for t in ids[3:]]
    steps = np.stack(steps)
    # close, not equal: like llama.cpp we sum in another order for one token than for a batch
    # (ggml's vec_dot vs its tiled and repacked kernels), and 8-bit activation rounding amplifies
    # that (measured 0.019 SmolLM2, 0.049 Gemma 3); a cache or position bug gives ~1
    diff = np.abs(steps - batch[2:]).mean() / batch.std()
    print(f"incremental vs batch: mean |diff| / std = {diff:.4f}")
    assert diff < 0.15
    assert (steps.argmax(1) == batch[2:].argmax(1)).mean() >= 0.75


def test_a_plan_gives_the_bits_of_op_by_op(any_model, monkeypatch):
    """The CPU backend's plans (every node bound once, its views and kernels resolved, one
    activation converted once for the products that share it) compute what binding and running
    each node anew does (graph_compute): the same bits, for a prompt and for decode steps."""
    m = any_model
    ctx = m.context
    ids = m.tokenize("The quick brown fox jumps over the lazy dog")

    def run() -> list[np.ndarray]:
        ctx.clear()
        return [ctx.decode(ids, all_logits=True)] + [ctx.decode([t]) for t in ids[:3]]
    planned = run()
    cpu = ctx.backends[-1]
    calls = []

    def op_by_op(plan):
        calls.append(plan)
        cpu.graph_compute(plan.graph)
    monkeypatch.setattr(cpu, "graph_plan_compute", op_by_op)
    one_by_one = run()
    assert calls, "the context did not compute through its CPU backend's plans"
    for a, b in zip(planned, one_by_one):
        assert np.array_equal(a, b)


def test_decode_graph_is_reused(any_model):
    ctx = any_model.context
    ctx.clear()
    ctx.decode(any_model.tokenize("Hello there, how are"))
    ctx.decode([ctx.tokens[-1]])
    graph = ctx._graph(1, ctx.kv.n_kv(), 1).graph
    key = ctx.sched._key
    for t in (11, 12, 13):
        ctx.decode([t])
    assert ctx._graph(1, ctx.kv.n_kv(), 1).graph is graph and ctx.sched._key == key


def test_prefix_reuse(any_model):
    """A cached prefix is reused up to where the rest reads as in a fresh run, and the logits
    are a fresh run's: SmolLM2's Q4_1 products compute each column alike however many there
    are, so only the new tokens are read (at least two: one alone would take the attention's
    single-token path); Gemma's K-quants are tiled from 8 columns and repacked in fours, so it
    reads 8 to 15 from a multiple of 8 (pyggml.batch_rules)."""
    m = any_model
    a = m.tokenize("One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen, "
                   "sixteen, seventeen, eighteen")
    list(m.generate(a, max_tokens=2, temperature=0))
    b = a + m.tokenize(" nineteen", add_bos=False)
    before = m.timings.prompt_tokens
    got = m.context.eval_prefix(b)
    evaluated = m.timings.prompt_tokens - before
    assert len(b) > 16
    if m.model.arch.name == "gemma3":
        assert 8 <= evaluated <= 15 and (len(b) - evaluated) % 8 == 0
    else:
        assert evaluated == max(2, len(b) - len(a))
    m.context.clear()
    assert np.array_equal(got, m.context.decode(b))


def test_context_full_is_a_clear_error():
    m = shared_model("smollm2")
    ctx = Context(m.model, n_ctx=8)
    ctx.decode(list(range(100, 106)))
    with pytest.raises(ContextFullError, match="context of 8 tokens is full"):
        ctx.decode(list(range(3)))
    assert list(shared_model("smollm2").generate(m.tokenize("Hi"), max_tokens=3, temperature=0))


def test_unsupported_architecture(tmp_path):
    import gguf
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture, match="unsupported architecture 'mamba'; supported: gemma3, gpt-oss, llama"):
        load_model(path)


def test_bad_token_ids():
    m = shared_model("smollm2")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.logits([1, m.n_vocab])

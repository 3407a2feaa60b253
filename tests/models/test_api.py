"""pyggml.Model: the llama-cpp-python-shaped Python API on a real model."""
from __future__ import annotations

import pytest

import pyggml

from tests.conftest import shared_model


@pytest.fixture(scope="module")
def m():
    return shared_model("smollm2")


def test_model_is_exported():
    assert pyggml.Model is type(shared_model("smollm2"))


def test_completion_dict(m):
    m.context.clear()
    r = m.create_completion("The capital of France is", max_tokens=8, temperature=0)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length" and "Paris" in choice["text"]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    again = m.create_completion("The capital of France is", max_tokens=8, temperature=0)
    assert again["choices"][0]["text"] == choice["text"]
    # a cached prefix is reused where the rest reads as in a fresh run (pyggml.batch_rules: for
    # SmolLM2's Q4_1 anywhere that leaves two tokens, the last one never read alone)
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    long_prompt = "The capital of France is Paris, the capital of Italy is Rome, and the capital of Spain is"
    first = m.create_completion(long_prompt, max_tokens=4, temperature=0)
    n = first["usage"]["prompt_tokens"]
    again = m.create_completion(long_prompt, max_tokens=4, temperature=0)
    assert n > 16 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 2
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_streaming_gives_the_same_text(m):
    whole = m.create_completion("Once upon a time", max_tokens=12, temperature=0)["choices"][0]["text"]
    chunks = list(m.create_completion("Once upon a time", max_tokens=12, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_seed_reproducibility(m):
    kw = dict(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = m.create_completion("My favourite animal is", seed=3, **kw)["choices"][0]["text"]
    b = m.create_completion("My favourite animal is", seed=3, **kw)["choices"][0]["text"]
    c = m.create_completion("My favourite animal is", seed=4, **kw)["choices"][0]["text"]
    assert a == b and a != c


def test_stop_strings(m):
    r = m.create_completion("1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"].strip().startswith("5") and " 7" not in r["choices"][0]["text"]


def test_chat_completion(m):
    messages = [{"role": "user", "content": "Name the capital of France."}]
    r = m.create_chat_completion(messages, max_tokens=30, temperature=0)
    assert r["object"] == "chat.completion"
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and "Paris" in msg["content"]
    assert r["choices"][0]["finish_reason"] == "stop"  # the model ended its turn with <|im_end|>
    chunks = list(m.create_chat_completion(messages, max_tokens=30, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]


def test_the_text_api_gives_the_completions_text(m):
    """What pyggml-chat prints (Model.answer, Model.complete_text: text, not OpenAI's objects)
    is the text of the OpenAI-shaped replies."""
    messages = [{"role": "user", "content": "Name the capital of France."}]
    pieces = list(m.answer(messages, max_tokens=30, temperature=0))
    assert all(reasoning == "" for reasoning, _ in pieces)  # not a reasoning model
    assert "".join(a for _, a in pieces) == m.create_chat_completion(messages, max_tokens=30,
                                                                      temperature=0)["choices"][0]["message"]["content"]
    text = "".join(m.complete_text("1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]))
    assert text == m.create_completion("1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])["choices"][0]["text"]
    assert m.usage.completion_tokens > 0


def test_gemma_chat_uses_the_builtin_turn_format():
    g = shared_model("gemma3-270m")
    ids = g.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == g.tokenizer.bos_id and ids.count(g.tokenizer.bos_id) == 1
    assert g.detokenize(ids, special=True).endswith("<start_of_turn>model\n")
    r = g.create_chat_completion([{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0)
    assert r["choices"][0]["message"]["content"].strip()


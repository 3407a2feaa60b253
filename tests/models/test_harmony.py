"""gpt-oss's harmony format: the reasoning (analysis channel) apart from the answer (final
channel), whole and streamed, in the OpenAI shapes the server and pyggml-chat use."""
from __future__ import annotations

import pytest

from pyggml.server.openai import Shape
from pyggml.models.harmony import HarmonyStream, is_harmony, split

REPLY = ("<|channel|>analysis<|message|>The user asks for 2+2. That is 4.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")


def test_a_whole_reply_splits_into_reasoning_and_answer():
    assert split(REPLY) == ("The user asks for 2+2. That is 4.", "2 + 2 = 4.")
    # a tool call's commentary channel is neither; a message cut short at the end keeps its text
    assert split("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hi") == \
        ("think", "Hi")
    assert split("no channels at all") == ("", "no channels at all")


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_pieces_add_up_and_never_show_a_marker(step):
    s = HarmonyStream()
    reasoning, answer = [], []
    for i in range(0, len(REPLY), step):
        r, a = s.push(REPLY[i:i + step])
        reasoning.append(r)
        answer.append(a)
    r, a = s.flush()
    reasoning.append(r)
    answer.append(a)
    assert ("".join(reasoning), "".join(answer)) == split(REPLY)
    assert not any("<|" in p or "|>" in p for p in reasoning + answer)


def test_chat_shapes_carry_reasoning_content():
    whole = Shape("chat", "gpt-oss", reasoning=True).reply(REPLY, "stop", _usage())
    message = whole["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "2 + 2 = 4.",
                       "reasoning_content": "The user asks for 2+2. That is 4."}
    stream = Shape("chat", "gpt-oss", reasoning=True)
    deltas = [stream.chunk(REPLY[i:i + 5])["choices"][0]["delta"] for i in range(0, len(REPLY), 5)]
    deltas.append(stream.chunk(None, "stop")["choices"][0]["delta"])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    # completions (raw text) and models without harmony are left as they are
    assert Shape("text", "gpt-oss", reasoning=True).reply(REPLY, "stop", _usage())["choices"][0]["text"] == REPLY
    assert Shape("chat", "smollm2").reply(REPLY, "stop", _usage())["choices"][0]["message"]["content"] == REPLY


def test_harmony_templates_are_recognized():
    assert is_harmony("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert not is_harmony("<|im_start|>assistant\n") and not is_harmony(None)


def _usage():
    from pyggml.models.completion import Usage
    return Usage()


def test_the_text_stream_keeps_control_tokens_when_asked():
    """Harmony's markers are control tokens: a harmony model's text is decoded with them (and
    only then can the channels be told apart)."""
    from pyggml.models.completion import TextStream

    from tests.conftest import shared_model
    tok = shared_model("smollm2").tokenizer
    ids = tok.tokenize("<|im_start|>assistant\nHi there<|im_end|>", special=True)
    kept, dropped = TextStream(tok, [], special=True), TextStream(tok, [])
    assert "".join(kept.push(i) for i in ids) + kept.flush() == "<|im_start|>assistant\nHi there<|im_end|>"
    assert "".join(dropped.push(i) for i in ids) + dropped.flush() == "assistant\nHi there"

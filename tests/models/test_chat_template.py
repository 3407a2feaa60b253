"""Chat templates: the file's own template, the built-in Gemma fallback, the sandbox."""
from __future__ import annotations

import pytest

from pyggml.models.chat import ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Capital of France?"}]


def test_smollm2_template_from_the_file(smollm2_path):
    from pyggml.gguf import GGUFFile
    src = GGUFFile(smollm2_path).get("tokenizer.chat_template")
    text = ChatTemplate(src, "llama").render(MESSAGES)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_gemma_fallback_turn_format():
    t = ChatTemplate(None, "gemma3", bos_token="<bos>")
    assert t.builtin
    text = t.render([{"role": "system", "content": "Be brief."}] + MESSAGES)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="alternate"):
        t.render([{"role": "assistant", "content": "x"}])


def test_tojson_and_raise_exception():
    t = ChatTemplate("{{ messages | tojson }}{% if messages|length > 1 %}{{ raise_exception('too many') }}{% endif %}",
                     "llama")
    assert t.render(MESSAGES[:1], add_generation_prompt=False) == '[{"role": "user", "content": "Hi"}]'
    with pytest.raises(ChatTemplateError, match="too many"):
        t.render(MESSAGES)


def test_sandbox_blocks_python_internals():
    t = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", "llama")
    with pytest.raises(ChatTemplateError):
        t.render(MESSAGES)


def test_bad_messages():
    with pytest.raises(ChatTemplateError, match="role"):
        ChatTemplate(None, "llama").render([{"content": "no role"}])

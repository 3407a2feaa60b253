"""Chat templates: the GGUF's ``tokenizer.chat_template`` rendered in a sandboxed jinja2
environment (as transformers and llama.cpp's jinja mode do), or a built-in template per
architecture when the file carries none."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Gemma's turn format: no system role, so a system message opens the first user turn
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ (system if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FALLBACK_TEMPLATES = {"gemma3": GEMMA_TEMPLATE, "llama": CHATML_TEMPLATE, "qwen2": CHATML_TEMPLATE,
                      "qwen3": CHATML_TEMPLATE}
NAMED_TEMPLATES = {"chatml": CHATML_TEMPLATE, "gemma": GEMMA_TEMPLATE}  # --chat-template NAME


class ChatTemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTemplate:
    def __init__(self, source: str | None, arch: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source or FALLBACK_TEMPLATES.get(arch, CHATML_TEMPLATE)
        self.builtin = source is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(self.source)
        except Exception as e:
            raise ChatTemplateError(f"the model's chat template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ChatTemplateError(f"a message must be a dict with 'role' and 'content', not {m!r}")
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except ChatTemplateError:
            raise
        except Exception as e:
            raise ChatTemplateError(f"rendering the chat template failed: {type(e).__name__}: {e}") from None

"""OpenAI-shaped completions, shared by ``Model`` (one sequence) and ``Engine`` (many):
the text stream that holds back half characters and stop strings, and the reply and
chunk objects of ``/v1/completions`` and ``/v1/chat/completions``."""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .harmony import HarmonyStream, split
from .tokenizer import Tokenizer


class TextStream:
    """Turns generated token ids into text pieces that are safe to show: no half UTF-8
    characters, and nothing that might be the start of a stop string.

    Each token decodes only the last few ids: the text of ids[anchor:] less that of
    ids[anchor:done], so that a piece's leading space - which SentencePiece drops at the start
    of a text - comes out as it does in the whole text, and a long answer costs the same per
    token as a short one."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], special: bool = False) -> None:
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.special = special  # control tokens decoded too (harmony's channel markers: harmony.py)
        self.ids: list[int] = []
        self.text = ""     # the text of ids[:done], whole characters
        self.done = 0
        self.anchor = 0    # decoding starts here; anchor_len: characters ids[anchor:done] decode to
        self.anchor_len = 0
        self.emitted = 0   # characters of the text already handed out
        self.stopped = False

    def _pending(self) -> str:
        return self.tokenizer.detokenize(self.ids[self.anchor:], self.special)[self.anchor_len:]

    def push(self, token: int) -> str:
        self.ids.append(token)
        tail = self.tokenizer.detokenize(self.ids[self.anchor:], self.special)
        new = tail[self.anchor_len:]
        if new.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return ""
        start, self.done = self.done, len(self.ids)
        self.text += new
        covered = self.tokenizer.detokenize(self.ids[start:self.done], self.special)
        if covered:  # the anchor moves up to the ids just covered ...
            self.anchor, self.anchor_len = start, len(covered)
        else:  # ... unless alone they decode to nothing (a lone space dropped, a control token)
            self.anchor_len = len(tail)
        text = self.text
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s)))
            if at >= 0:
                self.stopped = True
                return self._take(text[:at])
        return self._take(text[:len(text) - self._held(text)])

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that may begin a stop string (kept back)."""
        hold = 0
        for s in self.stop:
            if not text or text[-1] not in s:
                continue  # the usual case, at once
            for k in range(min(len(s), len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def flush(self) -> str:
        return "" if self.stopped else self._take(self.text + self._pending())

    def _take(self, text: str) -> str:
        piece = text[self.emitted:]
        self.emitted = max(self.emitted, len(text))
        return piece


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Shape:
    """The objects of one reply: ``kind`` is "chat" (chat.completion) or "text"
    (text_completion); one id for the whole reply, as OpenAI's streams have.  ``reasoning``
    (a harmony model, gpt-oss): a chat answer's analysis channel comes as ``reasoning_content``,
    its final channel as ``content``, as llama-server returns them."""
    kind: str
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    reasoning: bool = False

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.reasoning = self.reasoning and self.kind == "chat"
        self._channels = HarmonyStream() if self.reasoning else None

    def _obj(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _head(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self._obj(chunk), "created": self.created, "model": self.model}

    def reply(self, text: str, finish: str | None, usage: Usage, logprobs: Any = None) -> dict[str, Any]:
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            if self.reasoning:
                reasoning, message["content"] = split(text)
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(False), "choices": [choice], "usage": usage.as_dict()}

    def role_chunk(self) -> dict[str, Any] | None:
        """The first chunk of a chat stream (None for completions, which have no roles)."""
        if self.kind != "chat":
            return None
        return {**self._head(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]}

    def chunk(self, text: str | None, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if self._channels is not None:  # the channels' new text (at the end, what was held back)
                reasoning, answer = self._channels.push(text) if text is not None else self._channels.flush()
                delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", answer)) if v}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage.as_dict()}

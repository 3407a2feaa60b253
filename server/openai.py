"""OpenAI's objects: completions and chat completions, whole or as a stream of chunks, made
from what a generation gives (models/runner.py's text pieces, the engine's events).

``pyggml-server`` answers with them, as does the Python API's ``Model.create_completion``
(shaped like llama-cpp-python's).  ``submit`` is the engine's requests in these shapes, for
Python callers that batch.
"""
from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyggml.models.completion import Usage
from pyggml.models.engine import Engine, EngineStopped, Event, Options, Request
from pyggml.models.harmony import HarmonyStream, split
from pyggml.models.sampling import SamplingParams, checked_logit_bias


def usage_object(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


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
        return {**self._head(False), "choices": [choice], "usage": usage_object(usage)}

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
        return {**self._head(True), "choices": [], "usage": usage_object(usage)}


class Replies:
    """Engine events -> OpenAI chunks (streamed) or one reply (not streamed)."""

    def __init__(self, shape: Shape, kind: str, tokenizer, include_usage: bool = False) -> None:
        self.shape, self.kind, self.include_usage = shape, kind, include_usage
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.offset = 0

    def _lp(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not entries:
            return None
        if self.kind == "chat":
            return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                                  for _, t, lp in e["top"]]} for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t: lp for _, t, lp in e["top"]} for e in entries], "text_offset": offsets}

    def first(self) -> list[dict[str, Any]]:
        role = self.shape.role_chunk()
        return [role] if role is not None else []

    def chunks(self, ev: Event) -> list[dict[str, Any]]:
        if ev.kind == "piece":
            return [self.shape.chunk(ev.text, None, self._lp(ev.logprobs))]
        out = [self.shape.chunk(None, ev.finish)]
        if self.include_usage:
            out.append(self.shape.usage_chunk(ev.usage))
        return out

    def add(self, ev: Event) -> None:
        if ev.kind == "piece":
            self.parts.append(ev.text)
            self.logprobs.extend(ev.logprobs)
        elif ev.kind == "done":
            self.finish, self.usage = ev.finish, ev.usage

    def reply(self) -> dict[str, Any]:
        has_lp = bool(self.logprobs)
        lp = self._lp(self.logprobs) if has_lp else None
        return self.shape.reply("".join(self.parts), self.finish, self.usage, lp)


def submit(engine: Engine, prompt: str | Sequence[int] | None = None, *,
           messages: Sequence[dict[str, Any]] | None = None, stream: bool = True, max_tokens: int | None = None, temperature: float = 0.8, top_k: int = 40,
           top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
           frequency_penalty: float = 0.0, presence_penalty: float = 0.0, seed: int | None = None,
           stop: str | Sequence[str] | None = None, logprobs: int | None = None,
           include_usage: bool = False, logit_bias: dict[int, float] | None = None):
    """Complete ``prompt`` or answer ``messages``: an iterator of OpenAI-shaped chunks
    (``stream``) or the whole reply as a dict.  Safe to call from several threads;
    closing the iterator early cancels the request."""
    kind = "chat" if messages is not None else "text"
    ids = engine.prompt_ids(prompt, messages)
    options = Options(max_tokens, SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty,
                                                 frequency_penalty=frequency_penalty,
                                                 presence_penalty=presence_penalty,
                                                 logit_bias=checked_logit_bias(logit_bias, engine.model.n_vocab)),
                      seed, [stop] if isinstance(stop, str) else list(stop or []), logprobs)
    events: queue.Queue[Event] = queue.Queue()
    req = engine.start(ids, options, events.put)
    shape = Shape(kind, engine.model.name, reasoning=engine.model.harmony)
    replies = Replies(shape, kind, engine.model.tokenizer, include_usage)
    if not stream:
        try:
            while True:
                ev = events.get()
                if ev.kind == "error":
                    raise EngineStopped(ev.error)
                replies.add(ev)
                if ev.kind == "done":
                    return replies.reply()
        finally:
            req.cancel()
    return _chunks(req, events, replies)


def _chunks(req: Request, events: queue.Queue, replies: Replies) -> Iterator[dict[str, Any]]:
    try:
        yield from replies.first()
        while True:
            ev = events.get()
            if ev.kind == "error":
                raise EngineStopped(ev.error)
            yield from replies.chunks(ev)
            if ev.kind == "done":
                return
    finally:
        req.cancel()  # a no-op once it is done; frees the slot of an abandoned stream

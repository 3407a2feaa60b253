"""Reading OpenAI request bodies: every field checked for type and range before anything
reaches the engine, each problem one ``BadRequest`` naming the field (an HTTP 400)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pyggml.models.engine import Options
from pyggml.models.sampling import SamplingParams, checked_logit_bias

MAX_STOPS = 16
MAX_STOP_CHARS = 256  # each generated token is checked against every stop string
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_ID = 1 << 31


class BadRequest(ValueError):
    pass


@dataclass
class Completion:
    """A parsed /v1/completions or /v1/chat/completions body."""
    kind: str                                # "chat" or "text"
    model: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    stream: bool
    include_usage: bool
    options: Options


def _number(body: dict, name: str, default: float, lo: float = -math.inf, hi: float = math.inf,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a number, not {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise BadRequest(f"'{name}' must be {'above' if lo_open else 'at least'} {lo:g}"
                         + (f" and at most {hi:g}" if hi != math.inf else "") + f", not {v!r}")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{name}' must be an integer, not {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{name}' must be in {lo}..{hi if hi is not None else ''}, not {v}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, not {v!r}")
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise BadRequest("'stop' must be a string or a list of strings")
    if len(v) > MAX_STOPS:
        raise BadRequest(f"'stop' holds {len(v)} strings, more than {MAX_STOPS}")
    if any(len(x) > MAX_STOP_CHARS for x in v):
        raise BadRequest(f"a 'stop' string is longer than {MAX_STOP_CHARS} characters")
    return [s for s in v if s]


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or OpenAI's list of parts of type "text"."""
    c = message.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content: only parts of type 'text' are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")


def _messages(body: dict) -> list[dict[str, Any]]:
    ms = body.get("messages")
    if not isinstance(ms, list) or not ms:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(ms):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role {m['role']!r} is not one of system, user, assistant, tool")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": _content(m, i)})
    return out


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt of a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < MAX_TOKEN_ID]
        if bad:  # (the engine names ids outside the vocabulary; these are no machine integer)
            raise BadRequest(f"token id {bad[0]} in 'prompt' is outside the vocabulary")
        return p
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")


def parse_completion(body: Any, kind: str, n_vocab: int) -> Completion:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    n = _integer(body, "n", 1)
    if n != 1:
        raise BadRequest(f"'n' must be 1 (one choice per request), not {n}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    max_tokens = _integer(body, "max_completion_tokens", None, 0)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None, -1)  # llama-server's -1: no limit
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object")
    include_usage = _bool(so or {}, "include_usage", False)
    if kind == "chat":
        messages, prompt = _messages(body), None
        logprobs = (_integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
                    if _bool(body, "logprobs", False) else None)
    else:
        messages, prompt = None, _prompt(body)
        logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 0.8, 0.0, 2.0),
        top_k=int(_integer(body, "top_k", 40, 0)),
        top_p=_number(body, "top_p", 0.95, 0.0, 1.0, lo_open=True),
        min_p=_number(body, "min_p", 0.05, 0.0, 1.0),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0, 10.0, lo_open=True),
        repeat_last_n=int(_integer(body, "repeat_last_n", 64, -1)),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
    )
    try:
        sampling.logit_bias = checked_logit_bias(body.get("logit_bias"), n_vocab)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    seed = _integer(body, "seed", None, -2**63, 2**64 - 1)
    if seed is not None and seed < 0:
        seed = None  # llama-server's -1: a random seed
    options = Options(max_tokens if max_tokens is not None and max_tokens >= 0 else None, sampling,
                      seed, _stops(body), logprobs)
    if max_tokens == 0:
        raise BadRequest("'max_tokens' must be at least 1")
    return Completion(kind, model, messages, prompt, stream, include_usage, options)

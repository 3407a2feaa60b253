"""The text of a generation, shared by ``Model`` (one sequence) and ``Engine`` (many): the
stream that holds back half characters and stop strings, and a request's token counts.
OpenAI's objects are made of them in server/openai.py."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    """A request's token counts (server/openai.py writes them in OpenAI's shape)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

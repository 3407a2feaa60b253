"""gpt-oss's harmony format: an answer in channels, its reasoning apart from its final text.

A gpt-oss reply (the chat template ends its prompt with ``<|start|>assistant``) is a sequence of
messages::

    <|channel|>analysis<|message|>...reasoning...<|end|><|start|>assistant<|channel|>final<|message|>...answer...<|return|>

The ``analysis`` channel is the model's reasoning, ``final`` its answer (llama-server returns
them as ``reasoning_content`` and ``content``; ``pyggml-chat`` shows the answer, the reasoning
with ``--show-reasoning``).  The markers are special tokens, so the text is decoded with them.
:class:`HarmonyStream` splits a stream piece by piece, holding back what may be the start of a
marker; a reply without any marker is all answer.
"""
from __future__ import annotations

MESSAGE, CHANNEL = "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")


def is_harmony(template_source: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's files carry it)."""
    return bool(template_source) and CHANNEL in template_source and MESSAGE in template_source


class HarmonyStream:
    """push(text) -> (reasoning, answer): the new text of each, markers left out."""

    def __init__(self) -> None:
        self.pending = ""
        self.in_body = False
        self.channel = "final"
        self.started = False   # a marker was seen: before it, text is the answer (no harmony at all)

    def push(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, answer = [], []
        while self.pending:
            if not self.in_body:
                at = self.pending.find(MESSAGE)
                if at < 0:
                    if not self.started and "<" not in self.pending:
                        self.in_body, self.channel = True, "final"  # plain text: all answer
                        continue
                    break
                header, self.pending = self.pending[:at], self.pending[at + len(MESSAGE):]
                self.started, self.in_body = True, True
                self.channel = header.split(CHANNEL, 1)[1].split()[0] if CHANNEL in header else "final"
                continue
            ends = [(i, e) for e in ENDS if (i := self.pending.find(e)) >= 0]
            if ends:
                at, end = min(ends)
                (reasoning if self.channel == "analysis" else answer).append(self.pending[:at])
                self.pending = self.pending[at + len(end):]
                self.started, self.in_body = True, False
                continue
            held = _held(self.pending)
            (reasoning if self.channel == "analysis" else answer).append(self.pending[:len(self.pending) - held])
            self.pending = self.pending[len(self.pending) - held:]
            break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What is left at the end (a marker cut short is text after all)."""
        rest, self.pending = self.pending, ""
        if not rest or not self.in_body and self.started:
            return "", ""
        return (rest, "") if self.in_body and self.channel == "analysis" else ("", rest)


def _held(text: str) -> int:
    """Characters at the end of ``text`` that may begin a marker."""
    at = text.rfind("<|")
    if at < 0:
        return 1 if text.endswith("<") else 0
    tail = text[at:]
    return len(tail) if "|>" not in tail else 0


def split(text: str) -> tuple[str, str]:
    """A whole reply's (reasoning, answer)."""
    s = HarmonyStream()
    r1, a1 = s.push(text)
    r2, a2 = s.flush()
    return r1 + r2, a1 + a2

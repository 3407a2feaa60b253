"""The one generation core: a batch of sequences decoded, each sequence's next token drawn, and
each sequence's tokens turned into text.

``Model.generate`` runs it with one sequence; the Engine with the sequences its scheduler puts
into a step (scheduler.py).  What comes out of a sequence is what a token gave (``Took``):
a piece of text with its logprobs, and at the end the reason.  The server shapes those into
OpenAI's objects (server/openai.py); the CLI prints the text.

The draw is the same wherever the head of the model lies: with top-k (or greedy) only the top
of each row and the logits of the tokens the penalties and biases watch come back from the
device that computed them (Context.decode_batch's TopResult); a sequence that samples from the
whole row or wants logprobs reads whole rows.  Both sizes are rounded up to a few values, so
that sequences with other settings share the step's graph: a larger top is cut by the sampler,
and padding ids among the watched ones change no draw.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .completion import TextStream
from .sampling import Sampler


def shape_bucket(n: int) -> int:
    """0, or n rounded up to a power of two of at least 8."""
    return 0 if n <= 0 else max(8, 1 << (n - 1).bit_length())


@dataclass
class Took:
    """What one drawn token gave its sequence: ``counted`` unless it ended the generation (an
    end-of-generation token is not part of the answer); text safe to show now (half characters
    and what may begin a stop string are held back) with the logprobs of the tokens it covers;
    ``finish`` ("stop", "length") when the generation ended."""
    counted: bool
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None


class Generation:
    """One sequence's generation: its sampler, the ids its penalties read (the prompt and what
    was generated), its text so far, and when it ends (an end-of-generation token, a stop
    string, ``limit`` tokens)."""

    def __init__(self, seq: int, prompt: Sequence[int], sampler: Sampler, tokenizer, stop: Sequence[str] = (),
                 limit: int = 0, logprobs: int | None = None, special: bool = False) -> None:
        self.seq = seq
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.history = list(prompt)
        self.stream = TextStream(tokenizer, stop, special=special)
        self.limit = limit  # 0: no limit of its own
        self.logprobs = logprobs  # None: off; k: each token's logprob and the top k's
        self.n_gen = 0
        self.held: list[dict[str, Any]] = []  # logprobs of tokens whose text is held back

    @property
    def whole_rows(self) -> bool:
        """Whether its draw reads whole rows of logits (logprobs, or a sampler over the whole row)."""
        return self.logprobs is not None

    def take(self, token: int, logits: np.ndarray | None = None) -> Took:
        """The token drawn for this sequence (``logits``: its whole row, where it was read)."""
        if self.tokenizer.is_eog(token):
            return self.end("stop")
        self.n_gen += 1
        self.history.append(token)
        if self.logprobs is not None:
            self.held.append(self._logprob_entry(logits, token, self.logprobs))
        text = self.stream.push(token)
        took = Took(True, text, self.held if text else [])
        if text:
            self.held = []
        if self.stream.stopped:
            return self._ended(took, "stop")
        if self.limit and self.n_gen >= self.limit:
            return self._ended(took, "length")
        return took

    def end(self, reason: str) -> Took:
        """The generation ends here (no token taken): the text held back for a stop string that
        never came, and ``reason``."""
        return self._ended(Took(False), reason)

    def _ended(self, took: Took, reason: str) -> Took:
        tail = self.stream.flush()
        took.text += tail
        took.logprobs = took.logprobs + self.held
        self.held = []
        took.finish = reason
        return took

    def _logprob_entry(self, logits: np.ndarray, token: int, k: int) -> dict[str, Any]:
        z = logits.astype(np.float64)
        lse = float(np.log(np.exp(z - z.max()).sum()) + z.max())
        top = np.argpartition(-z, k - 1)[:k] if 0 < k < z.size else np.arange(0)
        top = top[np.argsort(-z[top], kind="stable")]
        text = self.tokenizer.detokenize
        return {"id": token, "token": text([token]), "logprob": float(z[token] - lse),
                "top": [(int(t), text([int(t)]), float(z[t] - lse)) for t in top]}


@dataclass
class PromptAnswer:
    """What the last token of a prompt read whole gave: its output row as the step decoded it -
    the top logits and the watched tokens' (``top``: ids, logits, watched ids, their logits),
    or the whole row.  A later request with the same prompt, in the slot whose cache still
    holds it, draws its first token from this row: the logits a new read would give, bit for
    bit, with no token read again (llama-server re-reads the last token instead)."""
    ids: tuple[int, ...]
    top: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    row: np.ndarray | None = None


class Runner:
    """Draws the next token of each of a step's sequences from one decoding of their batch."""

    def __init__(self, n_vocab: int, n_ctx: int) -> None:
        self.n_vocab, self.n_ctx = n_vocab, n_ctx

    def top_request(self, gens: Sequence[Generation]) -> tuple[int, np.ndarray | None]:
        """What the step's output rows need of the vocabulary: the top n_top logits of each
        row and the logits of each row's watched tokens (penalties, biases), or - when a row
        samples from the whole row or wants logprobs - whole rows (n_top 0)."""
        needs = [0 if g.whole_rows else g.sampler.n_top(self.n_vocab) for g in gens]
        if not needs or min(needs) == 0:
            return 0, None
        n_hist = shape_bucket(max(g.sampler.n_watched(self.n_ctx) for g in gens))
        hist = np.stack([g.sampler.watched(g.history, n_hist) for g in gens])
        return min(self.n_vocab, shape_bucket(max(needs))), hist

    def draw(self, decode: Callable[[int, np.ndarray | None], Any],
             gens: Sequence[Generation]) -> list[tuple[int, np.ndarray | None]]:
        """Each sequence's token (and its whole row of logits, where one was read) from
        ``decode(n_top, hist)``: the logits of one output row per sequence, in order (a whole
        [rows, n_vocab] array, or a TopResult with n_top)."""
        n_top, hist = self.top_request(gens)
        return self.sample(decode(n_top, hist), gens, n_top, hist)

    def sample(self, logits: Any, gens: Sequence[Generation], n_top: int,
               hist: np.ndarray | None) -> list[tuple[int, np.ndarray | None]]:
        """draw's second half: each sequence's token from the logits decoded for top_request's
        (n_top, hist)."""
        drawn = []
        for row, g in enumerate(gens):
            if n_top:
                ids, values, hist_values = logits.row(row)
                drawn.append((g.sampler.sample_top(ids, values, hist[row], hist_values, g.history), None))
            else:
                drawn.append((g.sampler.sample(logits[row], g.history), logits[row]))
        return drawn

    def answer_of(self, prompt: Sequence[int], logits: Any, i: int, n_top: int,
                  hist: np.ndarray | None) -> PromptAnswer:
        """Output row ``i`` of sample()'s logits, kept for a request with the same prompt."""
        if n_top:
            ids, values, hist_values = logits.row(i)
            watched = hist[i] if hist is not None else np.zeros(0, np.int32)
            return PromptAnswer(tuple(prompt), top=(ids.copy(), values.copy(), watched.copy(), hist_values.copy()))
        return PromptAnswer(tuple(prompt), row=np.array(logits[i]))

    def answers(self, answer: PromptAnswer, sampler: Sampler, history: Sequence[int], whole_rows: bool) -> bool:
        """Whether a sequence's first draw can come from ``answer``: its whole row, or a top at
        least as large as the sampler's with every token the sampler watches among those kept."""
        if answer.row is not None:
            return True
        if whole_rows:
            return False
        ids, _, watched, _ = answer.top
        n_top = sampler.n_top(self.n_vocab)
        return 0 < n_top <= len(ids) and bool(np.isin(sampler.watched_ids(history), np.concatenate([ids, watched])).all())

    def draw_answer(self, answer: PromptAnswer, gen: Generation) -> tuple[int, np.ndarray | None]:
        """A sequence's first token from the stored answer to its prompt (answers() said it can)."""
        if answer.row is not None:
            return gen.sampler.sample(answer.row, gen.history), answer.row
        ids, values, watched, watched_values = answer.top
        return gen.sampler.sample_top(ids, values, watched, watched_values, gen.history), None

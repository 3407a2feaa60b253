"""Picking the next token from logits, in llama.cpp's default order: logit biases (OpenAI's
``logit_bias``), penalties (repetition, frequency, presence, over the last ``repeat_last_n``
tokens), top-k, top-p, min-p, temperature, then a draw.  Temperature <= 0 means greedy."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pyggml.ranking import top_k_indices


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40           # <= 0: no limit
    top_p: float = 0.95       # 1.0: off
    min_p: float = 0.05       # 0.0: off
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64   # 0: no penalties, -1: the whole history
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)


MAX_LOGIT_BIAS = 1024  # biased tokens per request: each one's logit comes back every step


def checked_logit_bias(bias: dict | None, n_vocab: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id, or its decimal string -> a value in [-100, 100]) as
    {id: value}; ValueError naming what is wrong."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError("'logit_bias' must be an object mapping token ids to numbers")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"'logit_bias' names {len(bias)} tokens, more than {MAX_LOGIT_BIAS}")
    out = {}
    for key, value in bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else \
            int(key) if isinstance(key, str) and key.strip().isdecimal() and len(key) < 12 else None
        if token is None or not 0 <= token < n_vocab:
            raise ValueError(f"'logit_bias' key {key!r} is not a token id of the vocabulary (0..{n_vocab - 1})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ValueError(f"'logit_bias' value {value!r} for token {token} must be a number in [-100, 100]")
        out[token] = float(value)
    return out


class Sampler:
    """Draws tokens for one sequence, from a whole row of logits (``sample``) or from the top
    of one that stayed on the device (``sample_top``: the ids and logits of the largest, and
    those of the recent tokens); both give the same draw when top_k is set."""

    def __init__(self, params: SamplingParams, seed: int | None = None) -> None:
        self.params = params
        self.rng = np.random.default_rng(seed)

    def n_top(self, n_vocab: int) -> int:
        """How many of the largest logits ``sample_top`` needs: top_k, and room for as many
        tokens as the penalties and negative biases can push down (or 0: a whole row is needed).
        A token a bias pushes up is among the watched ones (``watched``), whose logits come
        back whatever their rank."""
        p = self.params
        k = 1 if p.temperature <= 0 else p.top_k
        if not 0 < k < n_vocab:
            return 0
        lowered = sum(1 for b in p.logit_bias.values() if b < 0)
        return min(n_vocab, k + (self.window() if p.penalizes else 0) + lowered)

    def window(self) -> int:
        """The most distinct tokens the penalties look at."""
        p = self.params
        return p.repeat_last_n if p.repeat_last_n > 0 else 1 << 30

    def n_watched(self, n_ctx: int) -> int:
        """The most tokens ``watched`` names: the penalties' window (no more than the context
        holds) and the biased tokens."""
        p = self.params
        return (min(self.window(), n_ctx) if p.penalizes else 0) + len(p.logit_bias)

    def watched_ids(self, history: Sequence[int]) -> np.ndarray:
        """The distinct tokens the biases and penalties apply to, sorted."""
        p = self.params
        ids = np.fromiter(p.logit_bias, dtype=np.int64, count=len(p.logit_bias))
        if p.penalizes and len(history):
            ids = np.concatenate([ids, history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history])
        return np.unique(ids)

    def watched(self, history: Sequence[int], n: int) -> np.ndarray:
        """watched_ids padded with token 0 to ``n`` ids: those whose logits a top-k step brings
        back beside the top (a padding id's true logit comes along, which changes no draw)."""
        out = np.zeros(n, dtype=np.int32)
        ids = self.watched_ids(history)[:n]
        out[:ids.size] = ids
        return out

    def _penalized(self, ids: np.ndarray, vals: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """``vals`` (the logits of ``ids``) with the biases added, then llama.cpp's penalties
        applied to the recent tokens."""
        p = self.params
        if p.logit_bias:
            bias_ids = np.fromiter(p.logit_bias, dtype=np.int64, count=len(p.logit_bias))
            bias = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
            order = np.argsort(bias_ids)
            bias_ids, bias = bias_ids[order], bias[order]
            at = np.minimum(np.searchsorted(bias_ids, ids), bias_ids.size - 1)
            hit = np.flatnonzero(bias_ids[at] == ids)
            vals = vals.copy()
            vals[hit] += bias[at[hit]]
        if not p.penalizes or not len(history):
            return vals
        recent, count = np.unique(np.asarray(history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history),
                                  return_counts=True)
        at = np.minimum(np.searchsorted(recent, ids), recent.size - 1)
        hit = np.flatnonzero(recent[at] == ids)
        vals = vals.copy()
        v = vals[hit]
        if p.repeat_penalty != 1.0:
            v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        vals[hit] = v - (count[at[hit]].astype(np.float32) * np.float32(p.frequency_penalty)
                         + np.float32(p.presence_penalty))
        return vals

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        vals = self._penalized(np.arange(logits.size), logits, history)
        if self.params.temperature <= 0:
            return int(np.argmax(vals))
        k = self.params.top_k if 0 < self.params.top_k < vals.size else vals.size
        ids = top_k_indices(vals, k)
        return self._draw(ids, vals[ids])

    def sample_top(self, ids: np.ndarray, vals: np.ndarray, hist_ids: np.ndarray, hist_vals: np.ndarray,
                   history: Sequence[int] = ()) -> int:
        """The draw ``sample`` makes over the whole row, from the ``n_top`` largest logits
        (``ids``, ``vals``) and the logits of the recent tokens: the top k after penalties lie
        among them."""
        all_ids = np.concatenate([np.asarray(ids, dtype=np.int64), np.asarray(hist_ids, dtype=np.int64)])
        all_vals = np.concatenate([np.asarray(vals, dtype=np.float32), np.asarray(hist_vals, dtype=np.float32)])
        all_ids, first = np.unique(all_ids, return_index=True)
        pen = self._penalized(all_ids, all_vals[first], history)
        order = np.lexsort((all_ids, -pen))  # largest first, equal values lowest id first: top_k_indices' rule
        if self.params.temperature <= 0:
            return int(all_ids[order[0]])
        order = order[:self.params.top_k]
        return self._draw(all_ids[order], pen[order])

    def _draw(self, ids: np.ndarray, logits: np.ndarray) -> int:
        """top-p, min-p, temperature and the draw, over candidates sorted largest first."""
        p = self.params
        z = logits.astype(np.float64)
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, z, probs = ids[:keep], z[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            ids, z = ids[keep], z[keep]
        z = z / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        return int(ids[self.rng.choice(ids.size, p=probs)])

"""Picking the next token from logits, in llama.cpp's default order: penalties (repetition,
frequency, presence, over the last ``repeat_last_n`` tokens), top-k, top-p, min-p,
temperature, then a draw.  Temperature <= 0 means greedy."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)


class Sampler:
    def __init__(self, params: SamplingParams, seed: int | None = None) -> None:
        self.params = params
        self.rng = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        if p.penalizes and len(history):
            recent, count = np.unique(np.asarray(history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history),
                                      return_counts=True)
            logits = logits.copy()
            vals = logits[recent]
            if p.repeat_penalty != 1.0:
                vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            logits[recent] = vals - (count.astype(np.float32) * np.float32(p.frequency_penalty)
                                    + np.float32(p.presence_penalty))
        if p.temperature <= 0:
            return int(np.argmax(logits))
        ids = np.arange(logits.size)
        if 0 < p.top_k < logits.size:
            ids = np.argpartition(-logits, p.top_k - 1)[:p.top_k]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        z = logits[ids].astype(np.float64)
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

"""Sampling: greedy, seeds, and each filter doing what it says."""
from __future__ import annotations

import numpy as np

from pyggml.models.sampling import Sampler, SamplingParams

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))


def draws(n=400, seed=0, **kw):
    s = Sampler(SamplingParams(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw}), seed)
    return [s.sample(LOGITS) for _ in range(n)]


def test_greedy():
    assert Sampler(SamplingParams(temperature=0)).sample(LOGITS) == 0
    assert set(draws(50, top_k=1)) == {0}


def test_same_seed_same_tokens():
    assert draws(seed=7) == draws(seed=7)
    assert draws(seed=7) != draws(seed=8)


def test_unfiltered_draws_follow_the_distribution():
    counts = np.bincount(draws(4000), minlength=5) / 4000
    assert np.allclose(counts, np.exp(LOGITS), atol=0.03)


def test_filters():
    assert set(draws(top_k=2)) == {0, 1}
    assert set(draws(top_p=0.7)) == {0, 1}          # 0.5 + 0.2 reaches 0.7
    assert set(draws(min_p=0.25)) == {0, 1, 2}       # 0.15 >= 0.25 * 0.5
    low = np.bincount(draws(2000, temperature=0.2), minlength=5)[0]
    assert low > 1900                                # a low temperature sharpens towards the top token


def test_repeat_penalty_discourages_recent_tokens():
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=100.0))
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    assert s.sample(logits, history=[0]) == 1
    assert s.sample(logits, history=[2]) == 0


def test_frequency_and_presence_penalties_are_llama_cpps():
    """logit -= count * frequency + (count > 0) * presence, over the last repeat_last_n tokens."""
    logits = np.array([2.0, 1.7, 1.0], dtype=np.float32)
    freq = Sampler(SamplingParams(temperature=0, frequency_penalty=0.2))
    assert freq.sample(logits, history=[0]) == 0          # 2.0 - 0.2 = 1.8 still beats 1.7
    assert freq.sample(logits, history=[0, 0]) == 1       # 2.0 - 0.4 = 1.6 does not
    pres = Sampler(SamplingParams(temperature=0, presence_penalty=0.5))
    assert pres.sample(logits, history=[0, 0, 0]) == 1    # once, however often it occurred
    assert pres.sample(np.array([2.0, 1.0, 0.0], dtype=np.float32), history=[0, 0, 0]) == 0
    window = Sampler(SamplingParams(temperature=0, frequency_penalty=1.0, repeat_last_n=2))
    assert window.sample(logits, history=[0, 2, 2]) == 0  # token 0 fell out of the window

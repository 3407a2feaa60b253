"""Sampling: greedy, seeds, and each filter doing what it says."""
from __future__ import annotations

import numpy as np
import pytest

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


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_k=40),
    dict(temperature=0.0, top_k=40, repeat_penalty=1.3),
    dict(temperature=1.2, top_k=5, top_p=0.9, min_p=0.1, repeat_penalty=1.5, frequency_penalty=0.5),
    dict(temperature=0.7, top_k=10, presence_penalty=-1.5, frequency_penalty=-0.5),  # penalties that raise
    dict(temperature=0.9, top_k=3, repeat_penalty=3.0, repeat_last_n=8),
    # biases that lift tokens from far down the row into the top k, and push the top ones out
    dict(temperature=0.0, top_k=40, logit_bias={17: 30.0, 999: 12.5, 0: -100.0, 5: -3.0}),
    dict(temperature=0.8, top_k=8, repeat_penalty=1.3, logit_bias={3: 9.0, 400: -9.0, 401: -9.0}),
])
def test_the_top_of_a_row_gives_the_draws_of_the_whole_row(params):
    """What the head's device sends back under top-k (the n_top largest logits and the
    recent tokens' ones) gives the same token, draw after draw, as the whole row."""
    from pyggml.cpu.ops import top_k_indices
    rng = np.random.default_rng(3)
    whole, top = Sampler(SamplingParams(**params), seed=11), Sampler(SamplingParams(**params), seed=11)
    history = list(rng.integers(0, 1000, 20))
    for _ in range(200):
        row = (np.round(rng.standard_normal(1000) * 4) / 4).astype(np.float32)  # many equal values
        row[history[-3:]] += 3  # recent tokens near the top, where the penalties move them
        lowered = [t for t, b in top.params.logit_bias.items() if b < 0]
        row[lowered] += 4  # tokens at the top that their biases push down
        n_top = top.n_top(row.size)
        assert n_top == min(1000, (1 if params["temperature"] <= 0 else params["top_k"])
                            + (top.window() if top.params.penalizes else 0) + len(lowered))
        ids = top_k_indices(row, n_top)
        hist = top.watched(history, top.n_watched(64))
        a = whole.sample(row, history)
        b = top.sample_top(ids, row[ids], hist, row[hist], history)
        assert a == b
        history.append(a)


@pytest.mark.parametrize("k", [1, 7, 40, 256, 257, 999])
def test_top_k_indices_is_the_head_of_the_full_order(k):
    """Largest first, equal values lowest index first - by a pass keeping the k best up to 256
    (numpy's argmax for 1), by a partition beyond: both the first k of a stable sort of the whole
    row, many values equal."""
    from pyggml import ranking
    from pyggml.cpu.ops import top_k_indices
    rng = np.random.default_rng(k)
    for _ in range(20):
        row = (np.round(rng.standard_normal(1000) * 3) / 3).astype(np.float32)
        order = np.lexsort((np.arange(row.size), -row))
        assert np.array_equal(top_k_indices(row, k), order[:k])
        assert np.array_equal(ranking.top_k_indices(row, k), order[:k])


@pytest.mark.parametrize("k", [1, 40, 256])
def test_the_top_k_pass_skips_groups_of_16_only_when_none_enters(k):
    """The top-k pass looks at a group of 16 values only when one beats the worst of the k: rows
    of any length (a tail of fewer than 16), ascending (every value enters), equal values
    straddling groups, NaN (below every number) - the first k of the full order every time."""
    from pyggml.cpu import nn
    rng = np.random.default_rng(100 + k)
    rows = [np.sort(rng.standard_normal(1037)), np.round(rng.standard_normal(4099) * 2) / 2,
            rng.standard_normal(k + 15), rng.standard_normal(262144)]
    with_nan = rng.standard_normal(2000)
    with_nan[rng.integers(0, 2000, 300)] = np.nan
    rows.append(with_nan)
    for row in rows:
        row = row.astype(np.float32)
        out = np.empty((1, k), dtype=np.int64)
        nn.top_k_rows(row.reshape(1, -1), k, out)
        key = np.where(np.isnan(row), -np.inf, row)
        order = np.lexsort((np.arange(row.size), np.isnan(row), -key))
        assert np.array_equal(out[0], order[:k])


@pytest.mark.parametrize("k", [1, 7, 256, 257, 600, 1000])
def test_top_k_indices_ranks_nan_below_every_number_on_both_paths(k):
    """k above 256 on a row holding NaN failed with a numpy broadcast error (the partition's
    k-th value was NaN, which compares with nothing); NaN ranks as -inf does, by index."""
    from pyggml import ranking
    from pyggml.cpu.ops import top_k_indices
    rng = np.random.default_rng(k)
    for nan_every in (3, 1):  # some NaN, then a row of nothing else
        row = (np.round(rng.standard_normal(1000) * 3) / 3).astype(np.float32)
        row[::nan_every] = np.nan
        row[5] = -np.inf
        order = np.lexsort((np.arange(row.size), -np.where(np.isnan(row), -np.inf, row)))
        assert np.array_equal(top_k_indices(row, k), order[:k])  # the CPU's TOP_K (a heap for k <= 256)
        assert np.array_equal(ranking.top_k_indices(row, k), order[:k])  # the sampler's

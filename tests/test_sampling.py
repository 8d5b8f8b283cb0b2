"""The inclusion-probability contract and Poisson sampling (docs/METHOD.md)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.seeding import assert_seeded_zero_without_a_generator

from kvcert import retained_count, inclusion_probabilities, poisson_sample

N_SINK, N_RECENT = 4, 32


def scores_for(shape, seed=0, kind="lognormal"):
    g = torch.Generator().manual_seed(seed)
    if kind == "lognormal":  # heavy-tailed, like attention scores
        return torch.exp(2.0 * torch.randn(*shape, generator=g))
    if kind == "uniform":
        return torch.rand(*shape, generator=g)
    raise ValueError(kind)


def _certain(n):
    pos = torch.arange(n)
    return (pos < N_SINK) | (pos >= n - N_RECENT)


@pytest.mark.parametrize("kind", ["lognormal", "uniform"])
@pytest.mark.parametrize(("n", "budget"), [(400, 100), (400, 200), (1000, 250), (150, 60)])
def test_contract(kind, n, budget):
    scores = scores_for((2, 3, n), seed=n + budget, kind=kind)
    pi = inclusion_probabilities(scores, budget, head_fraction=0.5, pi_min=1e-3)
    assert pi.shape == scores.shape and pi.dtype == torch.float32
    # Σπ = budget per row.
    torch.testing.assert_close(pi.double().sum(-1), torch.full((2, 3), float(budget), dtype=torch.float64), atol=1e-3, rtol=0)
    # Capped at 1, floored at pi_min.
    assert bool((pi <= 1.0).all()) and bool((pi >= 1e-3 * (1 - 1e-6)).all())
    certain = _certain(n)
    assert bool((pi[..., certain] == 1.0).all())
    n_top = int(0.5 * (budget - int(certain.sum())))
    for row_scores, row_pi in zip(scores.reshape(-1, n), pi.reshape(-1, n)):
        free = ~certain
        s, p = row_scores[free], row_pi[free]
        # Top slice: the n_top highest scores among non-sink, non-recent tokens are certain.
        top = torch.topk(s, n_top).indices
        assert bool((p[top] == 1.0).all())
        # Tail monotone in score (non-decreasing π as score increases).
        order = torch.argsort(s)
        assert bool((torch.diff(p[order]) >= -1e-6).all())
        # π ∝ score where neither the cap nor the floor binds.
        inner = (p > 1.01e-3) & (p < 0.999)
        if int(inner.sum()) >= 2:
            ratio = p[inner].double() / s[inner].double()
            assert float(ratio.max() / ratio.min()) < 1.0 + 1e-3


def test_cap_and_floor_bind_with_extreme_scores():
    n, budget = 500, 125
    scores = scores_for((1, n), seed=3)
    scores[0, 100:110] = 1e6  # huge: capped at 1 (beyond the top slice)
    scores[0, 200:300] = 0.0  # zero: floored at pi_min
    pi = inclusion_probabilities(scores, budget, head_fraction=0.0, pi_min=1e-3)
    assert bool((pi[0, 100:110] == 1.0).all())
    torch.testing.assert_close(pi[0, 200:300], torch.full((100,), 1e-3), atol=1e-7, rtol=0)
    assert abs(float(pi.double().sum()) - budget) <= 1e-3


def test_budget_at_least_n_gives_all_ones():
    scores = scores_for((3, 80), seed=4)
    assert bool((inclusion_probabilities(scores, 80) == 1).all())
    assert bool((inclusion_probabilities(scores, 500) == 1).all())


def test_tiny_budget_is_raised_to_sinks_plus_recent():
    n = 300
    scores = scores_for((2, n), seed=5)
    for budget in (0, 1, 10, N_SINK + N_RECENT):
        pi = inclusion_probabilities(scores, budget)
        assert abs(float(pi.double().sum(-1).max()) - (N_SINK + N_RECENT)) <= 1e-3
        assert bool((pi[..., _certain(n)] == 1).all())
        assert float(pi[..., ~_certain(n)].max()) <= 1e-3 + 1e-6  # nothing left for the tail but the floor
    assert retained_count(0.01, n) == N_SINK + N_RECENT
    assert retained_count(0.25, n) == round(0.25 * n) == 75  # round(budget·n) once above the sinks + recent window
    assert retained_count(1.0, n) == n
    with pytest.raises(ValueError):
        retained_count(0.0, n)


def test_nan_scores_rejected():
    scores = scores_for((2, 100), seed=6)
    scores[1, 50] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        inclusion_probabilities(scores, 50)


def test_uniform_tail_when_floor_exceeds_tail_budget():
    n = 2000
    scores = scores_for((1, n), seed=7)
    pi = inclusion_probabilities(scores, 40, head_fraction=0.0, pi_min=0.01)
    tail = pi[0, ~_certain(n)]
    torch.testing.assert_close(tail, torch.full_like(tail, float(tail[0])))
    assert abs(float(pi.double().sum()) - 40) <= 1e-3


def test_poisson_frequencies_match_pi():
    """Each sampled slot's frequency over 4000 draws within 4 standard errors of π: a two-sided false alarm of
    6.3e-5 per slot, at most 1.5% over the 237 sampled slots (union bound); the mean retained count within 4
    standard errors of the budget (6.3e-5). A slot kept with probability 0.5 where π = 0.4 is 13 standard
    errors away."""
    n, draws = 300, 4000
    pi = inclusion_probabilities(scores_for((n,), seed=8), 90).double()
    g = torch.Generator().manual_seed(123)
    freq = torch.stack([poisson_sample(pi, g) for _ in range(draws)]).double().mean(0)
    se = torch.sqrt(pi * (1 - pi) / draws)
    certain = pi == 1
    assert bool((freq[certain] == 1).all())
    z = (freq[~certain] - pi[~certain]).abs() / se[~certain]
    assert float(z.max()) <= 4.0 + 1e-9, float(z.max())
    # Realized retained count ≈ the budget.
    counts = torch.stack([poisson_sample(pi, g).sum() for _ in range(500)]).double()
    assert abs(float(counts.mean()) - 90) < 4 * math.sqrt(float((pi * (1 - pi)).sum()) / 500) + 1e-9


def test_poisson_sample_is_seeded_and_validated():
    pi = torch.full((2, 50), 0.3)
    a = poisson_sample(pi, torch.Generator().manual_seed(1))
    b = poisson_sample(pi, torch.Generator().manual_seed(1))
    assert a.dtype == torch.bool and a.shape == pi.shape and bool((a == b).all())
    assert not bool(poisson_sample(torch.zeros(100)).any())
    for bad in (torch.tensor([0.5, 1.5]), torch.tensor([-0.1]), torch.tensor([float("nan")])):
        with pytest.raises(ValueError):
            poisson_sample(bad)


def test_draws_without_a_generator_never_follow_torchs_global_generator():
    """The Poisson sample, top-k's tie-breaking jitter and the CLT sampler, given no generator, draw from one seeded
    0 (kvcert.seeding): the same as with a generator seeded 0, whatever torch's global generator holds. Top-k is
    checked on exact ties, which only the jitter orders."""
    from kvcert.designs import DesignOptions, topk_design
    from kvcert.peer_sampling import clt_importance_attention

    pi = torch.full((3, 200), 0.4)
    ties = torch.ones(1, 2, 300)  # every score equal: the kept set is the jitter's choice
    logits, values = torch.randn(300, generator=torch.Generator().manual_seed(2)), torch.eye(300)[:, :8]
    draws = {
        "poisson": lambda g: poisson_sample(pi, g),
        "topk": lambda g: topk_design(ties, 0.5, DesignOptions(n_sink=0, n_recent=0), generator=g).index,
        "clt": lambda g: clt_importance_attention(logits, values, torch.ones(300), epsilon=0.3, delta=0.1,
                                                  generator=g).draws,
    }
    for name, draw in draws.items():
        assert_seeded_zero_without_a_generator(draw, name)
        assert not torch.equal(draw(torch.Generator().manual_seed(1)), draw(torch.Generator().manual_seed(0))), name

"""The peers' CLT-sized with-replacement importance sampler (kvcert.peer_sampling) against a float64 reference
written from its definition: the kept set, the sample size from the pilot, the Hansen–Hurwitz ratio output."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from kvcert.peer_sampling import clt_importance_attention, clt_sample_size


def _layer(n=200, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(n, generator=g, dtype=torch.float64)
    values = torch.randn(n, dv, generator=g, dtype=torch.float64) + 0.5
    return logits, values


def _reference(logits, values, proposal, kept, draws, epsilon, delta, pilot):
    """float64, from the definition: ô = (Σ_K w v + (1/m) Σ_t w v / s) / (Σ_K w + (1/m) Σ_t w / s)."""
    n = logits.shape[0]
    rest = torch.ones(n, dtype=torch.bool)
    rest[kept] = False
    s = torch.where(rest, proposal, torch.zeros_like(proposal))
    s = s / s.sum()
    w = torch.exp(logits - logits.max())
    x = [float(w[i] / s[i]) for i in draws[:pilot]]
    mean, second = sum(x) / pilot, sum(v * v for v in x) / pilot
    z = NormalDist().inv_cdf(1 - delta / 2)
    size = max(pilot, math.ceil(z * z * (second - mean * mean) / (epsilon ** 2 * mean ** 2)))
    m = len(draws)
    num = sum(w[i] * values[i] for i in kept.tolist()) + sum(w[i] * values[i] / s[i] for i in draws.tolist()) / m
    den = sum(float(w[i]) for i in kept.tolist()) + sum(float(w[i] / s[i]) for i in draws.tolist()) / m
    return num / den, size


@pytest.mark.parametrize("epsilon, n_top", [(0.3, 0), (0.1, 10), (0.05, 5)])
def test_the_sampler_is_its_definition(epsilon, n_top):
    logits, values = _layer()
    proposal = torch.exp(logits / 2)  # positive on every token (unbiased), not proportional to w (m > pilot)
    sample = clt_importance_attention(logits, values, proposal, epsilon=epsilon, delta=0.05, n_sink=4, n_recent=16,
                                      n_top=n_top, pilot=24, generator=torch.Generator().manual_seed(1))
    expected_kept = set(range(4)) | set(range(184, 200))
    others = [i for i in range(200) if i not in expected_kept]
    expected_kept |= set(sorted(others, key=lambda i: -float(logits[i]))[:n_top])
    assert set(sample.kept.tolist()) == expected_kept
    assert not set(sample.draws.tolist()) & expected_kept
    out, size = _reference(logits, values, proposal, sample.kept, sample.draws, epsilon, 0.05, 24)
    assert sample.size == size == len(sample.draws)
    assert size > 24  # the bound asked for more than the pilot: the extra draws were taken
    torch.testing.assert_close(sample.out, out, rtol=1e-12, atol=1e-12)


def test_the_denominator_estimate_is_unbiased_and_meets_its_bound_about_as_often_as_stated():
    """Over repeated draws the relative error of the residual's denominator is within ε in about 1 − δ of them
    (CLT: a large-sample statement, so a loose band)."""
    logits, values = _layer(n=400, seed=3)
    proposal = torch.exp(logits / 2)
    n_sink, n_recent, epsilon, delta = 4, 16, 0.1, 0.1
    rest = torch.ones(400, dtype=torch.bool)
    rest[:n_sink] = rest[-n_recent:] = False
    w = torch.exp(logits - logits.max())
    exact = float(w[rest].sum())
    g = torch.Generator().manual_seed(7)
    errors = []
    for _ in range(400):
        sample = clt_importance_attention(logits, values, proposal, epsilon=epsilon, delta=delta, n_sink=n_sink,
                                          n_recent=n_recent, pilot=64, generator=g)
        drawn = torch.isfinite(sample.bias) & rest
        errors.append(abs(float((w[drawn] * torch.exp(sample.bias[drawn])).sum()) / exact - 1))
    covered = sum(e <= epsilon for e in errors) / len(errors)
    assert 1 - delta - 0.06 <= covered <= 1.0


def test_bad_inputs_say_what_is_wrong():
    logits, values = _layer()
    with pytest.raises(ValueError, match="epsilon=0"):
        clt_importance_attention(logits, values, logits.exp(), epsilon=0, delta=0.05)
    with pytest.raises(ValueError, match=r"delta=1.0: must lie in \(0, 1\)"):
        clt_sample_size(torch.ones(3), 0.1, 1.0)
    with pytest.raises(ValueError, match="must be"):
        clt_importance_attention(logits, values[:5], logits.exp(), epsilon=0.1, delta=0.05)

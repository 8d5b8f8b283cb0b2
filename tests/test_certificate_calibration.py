"""The certificate through the decode path, Monte Carlo over Poisson seeds: E‖e‖² / E tr V̂ ≈ 1.

tr V̂ is the linearized (first-order) variance of the Hájek output under Poisson sampling, so over draws
of the retained set the mean squared true error must match its mean. The setup makes the linearization
accurate, so that the check has teeth: a tiny random-weight Llama (4 query / 2 KV heads) whose attention is
diffuse, a 404-token prompt, SnapKV π at a 50% budget. About 80 slots per KV head are sampled with
π well above π_min, and no sampled slot carries a large share of the softmax weight, so the Hájek ratio
is close to its first-order expansion (relative error O(1/m) in the number m of sampled slots).

All draws are decoded in one batch by ``kvcert.generation.decode_batch`` with the oracle on; the first
decode step (question-aware: its query comes from the uncompressed prefill, the same in every draw) of
every (layer, KV head) is used. Draws are independent, so per-draw sums give the standard errors, and
every acceptance window is derived from the number of draws D at a stated false-alarm rate:

* ratio R = Σ‖e‖² / Σ tr V̂ (over draws, layers and heads): |R − 1| ≤ 0.05 + z·SE(R), SE by the delta
  method over draws, z = 3.29 (two-sided 0.1%): false alarm ≤ 0.1% when the true ratio is within 5% of 1
  (the linearization's allowance at this m);
* per-coordinate Wald coverage (nominal 95%): |coverage − 0.95| ≤ 0.015 + z·SE, the 0.015 allowing the
  normal approximation of a sum of about 80 terms; false alarm ≤ 0.1% under that allowance;
* the certificate's coverage P(‖e‖ ≤ √(tr V̂/δ)) ≥ 1 − δ − z·SE (one-sided: Chebyshev guarantees at least
  1 − δ when tr V̂ is the variance), false alarm ≤ 0.05%.

A sign error in the −log π offset makes R about 15 here.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from helpers.tiny_models import build, prompt

import kvcert
from kvcert.generation import decode_batch

DRAWS = 120
Z = 3.290526731491926  # two-sided 0.1% (one-sided 0.05%) normal quantile
DELTA = 0.05


@pytest.fixture(scope="module")
def draws():
    _, model, _ = build("llama", seed=0)
    context, question = prompt(5, n_context=400, n_question=4)
    state = kvcert.prefill(model, torch.cat([context, question], -1))
    selections = [kvcert.select(state, "snapkv", "poisson", 0.5, seed=s) for s in range(DRAWS)]
    sampled = [float((torch.isfinite(s.log_pi) & (s.log_pi < 0)).sum(-1).float().mean()) for s in selections[0]]
    assert min(sampled) >= 50  # the linearization's regime: many sampled slots per KV head
    results = decode_batch(model, state, selections, max_new_tokens=2, certify=True, oracle=True, delta=DELTA)
    frame = pd.concat([r.steps.assign(draw=d) for d, r in enumerate(results)], ignore_index=True)
    frame = frame[frame["step"] == 0]
    assert len(frame) == DRAWS * 2 * 2 and frame[["true_err", "trace_var", "wald_coverage"]].notna().all().all()
    return frame


def _per_draw(frame: pd.DataFrame, column: str, how: str = "sum") -> np.ndarray:
    return frame.groupby("draw")[column].agg(how).to_numpy()


def test_mean_squared_error_matches_mean_trace_of_the_variance(draws):
    a = _per_draw(draws.assign(e2=draws["true_err"] ** 2), "e2")
    b = _per_draw(draws, "trace_var")
    ratio = a.sum() / b.sum()
    se = np.std(a - ratio * b, ddof=1) / np.sqrt(len(a)) / b.mean()
    print(f"\nE‖e‖²/E tr V̂ = {ratio:.3f} ± {se:.3f} over {len(a)} draws")
    assert abs(ratio - 1) <= 0.05 + Z * se, (ratio, se)


def test_wald_coverage_is_nominal(draws):
    per_draw = _per_draw(draws, "wald_coverage", "mean")
    coverage, se = per_draw.mean(), per_draw.std(ddof=1) / np.sqrt(len(per_draw))
    print(f"\nper-coordinate Wald coverage {coverage:.4f} ± {se:.4f}")
    assert abs(coverage - 0.95) <= 0.015 + Z * se, (coverage, se)


def test_certificate_covers_at_least_one_minus_delta(draws):
    covered = (draws["true_err"] <= np.sqrt(draws["trace_var"] / DELTA)).astype(float)
    per_draw = _per_draw(draws.assign(c=covered), "c", "mean")
    coverage, se = per_draw.mean(), per_draw.std(ddof=1) / np.sqrt(len(per_draw))
    assert coverage >= 1 - DELTA - Z * se, (coverage, se)
    assert (draws["coverage"] == covered).all()  # the step table's own coverage column says the same

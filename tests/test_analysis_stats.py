"""Tests of our own statistics code (kvcert.analysis.stats / verdicts / replay) on numbers we generate.

Each weighted statistic is checked against a standard implementation (scikit-learn's ROC AUC and ROC curve,
SciPy's Spearman) on the expanded sample, so the bootstrap (which passes item multiplicities as weights)
computes exactly what it claims to.
"""

import numpy as np
import pytest
from scipy import stats as sps
from sklearn.metrics import roc_auc_score, roc_curve

from kvcert.analysis import replay, stats, verdicts
from kvcert.analysis.stats import Interval


def test_auc_matches_scikit_learn_with_ties():
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(20):
        n = rng.integers(5, 60)
        scores = rng.integers(0, 6, n).astype(float)  # many ties
        labels = rng.random(n) < 0.4
        if labels.all() or (~labels).all():
            continue
        assert stats.auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
        checked += 1
    assert checked >= 15


def test_weighted_auc_equals_auc_of_expanded_sample():
    rng = np.random.default_rng(2)
    scores = rng.normal(size=40).round(1)
    labels = rng.random(40) < 0.5
    W = rng.integers(0, 4, size=(5, 40)).astype(float)
    got = stats.auc(scores, labels, W)
    for b in range(5):
        rep = np.repeat(np.arange(40), W[b].astype(int))
        assert got[b] == pytest.approx(roc_auc_score(labels[rep], scores[rep]), abs=1e-12)
        assert got[b] == pytest.approx(roc_auc_score(labels, scores, sample_weight=W[b]), abs=1e-12)


def test_roc_curve_points_equal_scikit_learn():
    rng = np.random.default_rng(8)
    scores = rng.integers(0, 8, 70).astype(float)
    labels = rng.random(70) < 0.3
    fpr, tpr = stats.roc_curve(scores, labels)
    ref_fpr, ref_tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr, ref_fpr, atol=1e-12)
    np.testing.assert_allclose(tpr, ref_tpr, atol=1e-12)


def test_auc_undefined_when_a_class_is_empty():
    assert np.isnan(stats.auc([0.1, 0.2], [True, True]))


def test_spearman_matches_scipy_and_expanded_sample():
    rng = np.random.default_rng(3)
    x = rng.normal(size=50).round(1)
    y = x + rng.normal(size=50)
    assert stats.spearman(x, y) == pytest.approx(sps.spearmanr(x, y).statistic)
    w = rng.integers(0, 4, size=50).astype(float)
    rep = np.repeat(np.arange(50), w.astype(int))
    assert stats.spearman(x, y, w) == pytest.approx(sps.spearmanr(x[rep], y[rep]).statistic)


def test_weighted_median_equals_median_of_expanded_sample():
    rng = np.random.default_rng(4)
    x = rng.normal(size=31)
    assert stats.Median(x)() == pytest.approx(np.median(x))
    W = rng.integers(0, 3, size=(6, 31)).astype(float)
    got = stats.Median(x)(W)
    for b in range(6):
        assert got[b] == pytest.approx(np.median(np.repeat(x, W[b].astype(int))))


def test_top_fraction_selects_exactly_q_and_splits_ties():
    top = stats.TopFraction([5.0, 4.0, 3.0, 2.0])
    assert np.allclose(top(0.5), [1, 1, 0, 0])
    assert np.allclose(stats.TopFraction(np.zeros(8))(0.25), 0.25)  # constant score = random gate
    tied = stats.TopFraction([3.0, 1.0, 1.0, 0.0])(0.5)  # one slot left for two tied runs
    assert np.allclose(tied, [1, 0.5, 0.5, 0])


def test_random_gate_equals_analytic_expectation():
    rng = np.random.default_rng(5)
    low = (rng.random(100) < 0.5).astype(float)
    better = np.maximum(low, rng.random(100) < 0.7)
    rep = replay.Replay(low, better, {"certificate": rng.normal(size=100)}, np.arange(100), 100)
    q = 0.25
    assert rep.accuracy("random", q)[0] == pytest.approx(100 * (low.mean() + q * (better - low).mean()))


# Bootstrap coverage: S simulated data sets, each with its own percentile interval of the mean. The window is
# derived from S, midway between 0.95 and the alternatives it must reject: 0.90 (an interval too narrow) and
# 0.99 (too wide). The percentile bootstrap of a mean under-covers by O(1/n) (about 0.94 at n = 100), so the
# null hypothesis is a true coverage in [0.94, 0.95].
COVERAGE_SIMULATIONS = 2000
COVERAGE_WINDOW = (0.925, 0.97)


def test_bootstrap_coverage_window_tells_95_from_90_and_99():
    """The window's error rates, from the binomial law of S draws: a false alarm (a correct bootstrap
    outside the window) at most 0.5%, and a miss (a 90% or 99% interval inside it) at most 0.1%."""
    lo, hi = (round(COVERAGE_SIMULATIONS * w) for w in COVERAGE_WINDOW)

    def inside(p):
        return sps.binom.cdf(hi, COVERAGE_SIMULATIONS, p) - sps.binom.cdf(lo - 1, COVERAGE_SIMULATIONS, p)

    assert 1 - inside(0.95) <= 1e-3 and 1 - inside(0.94) <= 5e-3
    assert inside(0.90) <= 1e-3 and inside(0.99) <= 1e-3


def test_bootstrap_ci_covers_the_truth_in_a_seeded_simulation():
    """Percentile CI of a mean (n = 100, 400 replicates): its coverage over COVERAGE_SIMULATIONS data sets
    lies in COVERAGE_WINDOW (error rates in the test above)."""
    rng = np.random.default_rng(6)
    hits = 0
    for k in range(COVERAGE_SIMULATIONS):
        x = rng.normal(1.0, 1.0, size=100)
        iv = stats.cluster_bootstrap(lambda W: stats.weighted_mean(x, W), 100, n_boot=400, seed=k)[0]
        hits += iv.low <= 1.0 <= iv.high
    coverage = hits / COVERAGE_SIMULATIONS
    assert COVERAGE_WINDOW[0] <= coverage <= COVERAGE_WINDOW[1], coverage


def test_bootstrap_is_seeded_and_paired():
    """Statistics bootstrapped together share every resample. With y = 2x + 1, each replicate of mean(y) is
    2 mean(x) + 1 of the same resample, so the percentile intervals map exactly onto each other; on
    separate resamples (the control: another seed for y) they differ by resampling noise."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=30)
    y = 2 * x + 1

    def mean(values):
        return lambda W: stats.weighted_mean(values, W)

    both = lambda W: np.column_stack([mean(x)(W), mean(y)(W)])
    a = stats.cluster_bootstrap(both, 30, n_boot=300, seed=3)
    assert a == stats.cluster_bootstrap(both, 30, n_boot=300, seed=3)
    assert a != stats.cluster_bootstrap(both, 30, n_boot=300, seed=4)
    ix, iy = a
    assert (iy.low, iy.high) == pytest.approx((2 * ix.low + 1, 2 * ix.high + 1), abs=1e-12)
    alone_x = stats.cluster_bootstrap(mean(x), 30, n_boot=300, seed=3)[0]
    alone_y = stats.cluster_bootstrap(mean(y), 30, n_boot=300, seed=4)[0]
    assert alone_x == ix  # one statistic or two: the seed alone decides the resamples
    assert max(abs(alone_y.low - (2 * ix.low + 1)), abs(alone_y.high - (2 * ix.high + 1))) > 1e-3


# claims.yaml's verdict_rule with t = 0, m = 1: supported iff low > 0; else not supported iff high < 1; else
# inconclusive (also for an undefined interval)
@pytest.mark.parametrize("lo,hi,verdict", [
    (0.1, 0.5, verdicts.SUPPORTED), (-0.5, 0.5, verdicts.NOT_SUPPORTED), (-2.0, -0.5, verdicts.NOT_SUPPORTED),
    (-0.5, 1.5, verdicts.INCONCLUSIVE), (float("nan"), float("nan"), verdicts.INCONCLUSIVE),
])
def test_decision_rule_with_null_margin(lo, hi, verdict):
    rule = {"threshold": 0.0, "direction": "greater", "null_margin": 1.0}
    assert verdicts.decide("x", Interval(0.0, lo, hi, 1, 0), rule).verdict == verdict


def test_combine_and_binding():
    rule = {"threshold": 0.0}
    a = verdicts.decide("a", Interval(2.0, 1.0, 3.0, 1, 0), rule)
    b = verdicts.decide("b", Interval(1.0, 0.2, 2.0, 1, 0), rule)
    c = verdicts.decide("c", Interval(-2.0, -3.0, -1.0, 1, 0), rule)
    assert verdicts.combine([a, b]) == verdicts.SUPPORTED and verdicts.binding([a, b]).name == "b"
    assert verdicts.combine([a, c]) == verdicts.NOT_SUPPORTED and verdicts.binding([a, c]).name == "c"
    assert verdicts.agrees(verdicts.INCONCLUSIVE, "supported") is None

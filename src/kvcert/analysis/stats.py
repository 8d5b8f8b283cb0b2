"""Bootstrap and rank statistics for the claim analyses (numpy only, vectorized, seeded).

Every statistic here accepts *multiplicity weights*: a bootstrap resample of items is represented
by how many times each item was drawn, never by copying rows. A weight matrix ``W`` has one row
per bootstrap replicate and one column per observation; the point estimate is the same function
evaluated at ``W = ones``. This keeps pairing exact (both arms of a paired comparison see the same
weights) and makes cluster resampling cheap (item weights are broadcast onto the item's rows).

Weighted definitions reduce to the textbook ones for integer weights: a weighted AUC equals the
Mann-Whitney AUC of the expanded sample, a weighted Spearman equals Spearman of the expanded sample
(mid-ranks for ties), a weighted median equals the median of the expanded sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

# Bootstrap replicates are evaluated in blocks so that (block x rows) float arrays stay small.
_MAX_BLOCK_CELLS = 4_000_000


@dataclass(frozen=True)
class Interval:
    """A point estimate with its percentile bootstrap confidence interval."""

    estimate: float
    low: float
    high: float
    n_boot: int
    n_invalid: int  # replicates where the statistic was undefined (e.g. a class vanished)

    def as_dict(self) -> dict:
        return {
            "estimate": self.estimate,
            "ci_low": self.low,
            "ci_high": self.high,
            "n_boot": self.n_boot,
            "n_invalid": self.n_invalid,
        }


def block_size(n_rows: int) -> int:
    """Replicates per block so that a (block x n_rows) array holds about 4M floats."""
    return int(max(1, min(512, _MAX_BLOCK_CELLS // max(1, n_rows))))


def cluster_bootstrap(
    stat: Callable[[np.ndarray], np.ndarray],
    n_clusters: int,
    *,
    n_boot: int,
    seed: int,
    alpha: float = 0.05,
    rows_per_cluster: float = 1.0,
) -> list[Interval]:
    """Percentile bootstrap over clusters (items) for one or several statistics at once.

    ``stat(W)`` receives a (B, n_clusters) float matrix of resampling multiplicities and returns a
    (B,) or (B, K) array; the K statistics share the same resamples, which makes differences
    between them paired. Returns K intervals. NaN replicates (statistic undefined in a resample)
    are left out of the percentiles and counted.
    """
    if n_clusters < 1:
        raise ValueError("cluster_bootstrap needs at least one cluster")
    point = np.atleast_1d(np.asarray(stat(np.ones((1, n_clusters))), dtype=float)[0])
    rng = np.random.default_rng(seed)
    block = block_size(int(np.ceil(n_clusters * rows_per_cluster)))
    probs = np.full(n_clusters, 1.0 / n_clusters)
    reps = []
    done = 0
    while done < n_boot:
        b = min(block, n_boot - done)
        W = rng.multinomial(n_clusters, probs, size=b).astype(float)
        out = np.asarray(stat(W), dtype=float)
        reps.append(out.reshape(b, -1))
        done += b
    R = np.concatenate(reps, axis=0)
    q = [100 * alpha / 2, 100 * (1 - alpha / 2)]
    intervals = []
    for k in range(R.shape[1]):
        col = R[:, k]
        ok = np.isfinite(col)
        lo, hi = (np.percentile(col[ok], q) if ok.any() else (np.nan, np.nan))
        intervals.append(Interval(float(point[k]), float(lo), float(hi), int(n_boot), int((~ok).sum())))
    return intervals


# --- tie groups -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Groups:
    """Sort order of a score vector and its tie groups (computed once, reused per replicate)."""

    order: np.ndarray  # argsort of the scores (ascending)
    starts: np.ndarray  # start index of each tie group in sorted order
    group_of_sorted: np.ndarray  # tie-group index of each sorted position


def _groups(x: np.ndarray, descending: bool = False) -> _Groups:
    x = np.asarray(x, dtype=float)
    if np.isnan(x).any():
        raise ValueError("scores contain NaN; drop those rows first")
    key = -x if descending else x
    order = np.argsort(key, kind="stable")
    xs = key[order]
    new = np.empty(len(xs), dtype=bool)
    new[:1] = True
    new[1:] = xs[1:] != xs[:-1]
    starts = np.flatnonzero(new)
    return _Groups(order, starts, np.cumsum(new) - 1)


def _as_weights(weights: np.ndarray | None, n: int) -> np.ndarray:
    if weights is None:
        return np.ones((1, n))
    W = np.atleast_2d(np.asarray(weights, dtype=float))
    if W.shape[1] != n:
        raise ValueError(f"weights have {W.shape[1]} columns for {n} observations")
    return W


def _squeeze(out: np.ndarray, weights) -> np.ndarray | float:
    return float(out[0]) if weights is None or np.ndim(weights) == 1 else out


# --- AUC --------------------------------------------------------------------------------------


def auc(scores, labels, weights=None):
    """Mann-Whitney AUC = P(score_pos > score_neg) + 0.5 P(tie), with multiplicity weights.

    ``labels`` is boolean (True = positive). Returns a float (weights None or 1-D) or a (B,) array;
    NaN where a class has zero weight.
    """
    scores = np.asarray(scores, dtype=float)
    pos = np.asarray(labels, dtype=bool)
    W = _as_weights(weights, len(scores))
    if len(scores) == 0:
        return _squeeze(np.full(W.shape[0], np.nan), weights)
    g = _groups(scores)
    Ws = W[:, g.order]
    ps = pos[g.order]
    P = np.add.reduceat(Ws * ps, g.starts, axis=1)
    N = np.add.reduceat(Ws * ~ps, g.starts, axis=1)
    below = np.cumsum(N, axis=1) - N
    num = (P * (below + 0.5 * N)).sum(axis=1)
    den = P.sum(axis=1) * N.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
    return _squeeze(out, weights)


def roc_curve(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    """ROC points (fpr, tpr) sweeping the threshold from high to low scores (ties moved together)."""
    scores = np.asarray(scores, dtype=float)
    pos = np.asarray(labels, dtype=bool)
    if len(scores) == 0 or pos.all() or (~pos).all():
        return np.array([0.0, 1.0]), np.array([0.0, 1.0])
    g = _groups(scores, descending=True)
    ps = pos[g.order].astype(float)
    tp = np.add.reduceat(ps, g.starts)
    fp = np.add.reduceat(1.0 - ps, g.starts)
    tpr = np.concatenate([[0.0], np.cumsum(tp) / ps.sum()])
    fpr = np.concatenate([[0.0], np.cumsum(fp) / (1.0 - ps).sum()])
    return fpr, tpr


# --- ranks, Spearman, median ------------------------------------------------------------------


def _midranks(x_groups: _Groups, W: np.ndarray) -> np.ndarray:
    """Weighted mid-ranks: the rank each observation would get in the expanded sample."""
    Ws = W[:, x_groups.order]
    gw = np.add.reduceat(Ws, x_groups.starts, axis=1)
    before = np.cumsum(gw, axis=1) - gw
    rank_g = before + (gw + 1.0) / 2.0
    ranks = np.empty_like(Ws)
    ranks[:, x_groups.order] = rank_g[:, x_groups.group_of_sorted]
    return ranks


def _weighted_pearson(a: np.ndarray, b: np.ndarray, W: np.ndarray) -> np.ndarray:
    tot = W.sum(axis=1, keepdims=True)
    ma = (W * a).sum(axis=1, keepdims=True) / tot
    mb = (W * b).sum(axis=1, keepdims=True) / tot
    da, db = a - ma, b - mb
    cov = (W * da * db).sum(axis=1)
    va = (W * da * da).sum(axis=1)
    vb = (W * db * db).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return cov / np.sqrt(va * vb)


class Spearman:
    """Spearman rank correlation of fixed (x, y) under many weight vectors.

    The sort/tie structure is computed once; each replicate then costs O(n).
    """

    def __init__(self, x, y):
        self.gx = _groups(np.asarray(x, dtype=float))
        self.gy = _groups(np.asarray(y, dtype=float))
        self.n = len(self.gx.order)

    def __call__(self, weights=None):
        W = _as_weights(weights, self.n)
        out = _weighted_pearson(_midranks(self.gx, W), _midranks(self.gy, W), W)
        return _squeeze(out, weights)


def spearman(x, y, weights=None):
    """Spearman correlation with mid-ranks for ties (equals scipy.stats.spearmanr at unit weights)."""
    return Spearman(x, y)(weights)


class Median:
    """Median of a fixed sample under many weight vectors (median of the expanded sample)."""

    def __init__(self, x):
        x = np.asarray(x, dtype=float)
        self.order = np.argsort(x, kind="stable")
        self.xs = x[self.order]

    def __call__(self, weights=None):
        W = _as_weights(weights, len(self.xs))[:, self.order]
        cw = np.cumsum(W, axis=1)
        total = cw[:, -1]
        # 1-based positions of the two middle elements of the expanded sample
        lo_pos = np.floor((total + 1) / 2)
        hi_pos = np.ceil((total + 1) / 2)
        lo = self.xs[np.argmax(cw >= lo_pos[:, None], axis=1)]
        hi = self.xs[np.argmax(cw >= hi_pos[:, None], axis=1)]
        out = np.where(total > 0, (lo + hi) / 2, np.nan)
        return _squeeze(out, weights)


# --- fractional top-q selection (gating / recompute replays) ------------------------------------


class TopFraction:
    """Which observations a gate selects when it fires for the top fraction q by score.

    Exactly q of the total weight is selected; observations tied at the boundary share the
    remaining quota equally (the expectation over random tie-breaking), so a constant score
    reproduces random gating exactly.
    """

    def __init__(self, scores):
        self.g = _groups(np.asarray(scores, dtype=float), descending=True)
        self.n = len(self.g.order)

    def __call__(self, q: float, weights=None) -> np.ndarray:
        """Fraction selected per observation, shape (B, n) (or (n,) for weights None / 1-D)."""
        W = _as_weights(weights, self.n)
        Ws = W[:, self.g.order]
        gw = np.add.reduceat(Ws, self.g.starts, axis=1)
        before = np.cumsum(gw, axis=1) - gw
        cap = q * W.sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(gw > 0, np.clip((cap - before) / np.where(gw > 0, gw, 1.0), 0.0, 1.0), 0.0)
        F = np.empty_like(Ws)
        F[:, self.g.order] = frac[:, self.g.group_of_sorted]
        return F[0] if weights is None or np.ndim(weights) == 1 else F


def weighted_mean(values, W: np.ndarray) -> np.ndarray:
    """Row-wise weighted mean of a value vector (B,) or of a value matrix, one column each (B, K)."""
    W = np.atleast_2d(np.asarray(W, dtype=float))
    out = W @ np.asarray(values, dtype=float)
    total = W.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return out / (total[:, None] if out.ndim == 2 else total)

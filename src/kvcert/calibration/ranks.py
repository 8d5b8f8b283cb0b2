"""Spearman's rank correlation, the one helper for everything outside the pre-registered analysis.

The pre-registered claims rank with ``kvcert.analysis.stats.spearman`` (frozen by the pre-registration, and
weighted so that the bootstrap can pass item multiplicities). Everything else ranks with ``spearman`` here:
the fit's choice of base certificate, the per-layer table and the calibration study. At unit weights the two
agree to rounding (about 1e-16), not bit for bit, which is why the tables written with this one keep it.
"""

from __future__ import annotations

import numpy as np


def spearman(x: np.ndarray, y: np.ndarray, *, degenerate: float = float("nan")) -> float:
    """Spearman's ρ of paired samples x and y, (N,) each: tied values take their average rank
    (``scipy.stats.spearmanr``); a NaN in either gives NaN.

    ``degenerate`` is returned where nothing can be ranked: fewer than 3 pairs, or every value of x (or of
    y) the same. The per-layer table reports NaN there; a fit's comparison of candidate bases passes −1, so
    that such a candidate ranks no better than the worst.
    """
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < 3 or np.all(x == x[0]) or np.all(y == y[0]):
        return float(degenerate)
    return float(spearmanr(x, y).statistic)

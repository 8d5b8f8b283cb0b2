"""The per-layer table the workflow reports (rule ``calibration_by_layer``): coverage with its Wilson
interval, width and rank correlation of ε̂, and of the calibrated certificate where the rows carry it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .corrections import ROUNDING, output_norm
from .ranks import spearman

Z95 = 1.959963984540054


def wilson_interval(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (rows as independent trials)."""
    if n <= 0:
        return float("nan"), float("nan")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


BY_LAYER_KEYS = ["model", "setting", "policy", "design", "budget", "layer"]


def by_layer(steps: pd.DataFrame, keys: list[str] | None = None) -> pd.DataFrame:
    """Calibration of the certificate ``cert`` = √(tr V̂/δ) per ``keys`` (default ``BY_LAYER_KEYS``, of which
    ``model`` is optional), one row each.

    Over the rows with a certificate and a true error: n_rows, n_items, coverage with its 95% Wilson
    interval (rows as independent trials: rows of one item are not, so it is narrower than an item-level
    interval), mean Wald coverage, median relative width ε̂/‖ô‖, Spearman(ε̂, ‖ô − o‖), and
    uncovered_at_rounding, the uncovered rows whose error is float32 rounding (≤ ``ROUNDING`` ‖ô‖: ε̂ = 0
    where nothing in the layer's view was evicted); and, where the rows carry ``cert_calibrated``, the
    same for the calibrated certificate.
    """
    keys = [k for k in (keys or BY_LAYER_KEYS) if k in steps.columns]
    ok = np.isfinite(steps["cert"].to_numpy(float)) & np.isfinite(steps["true_err"].to_numpy(float))
    rows = steps[ok]
    calibrated = "cert_calibrated" in rows.columns
    out = []
    for key, sub in rows.groupby(keys, sort=True):
        e, c = sub["true_err"].to_numpy(float), sub["cert"].to_numpy(float)
        rel = sub["rel_cert"].to_numpy(float)
        record = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        covered = float((e <= c).sum())
        low, high = wilson_interval(covered, len(sub))
        rounding = (e > c) & (e <= ROUNDING * output_norm(sub))
        record.update(n_rows=len(sub), n_items=int(sub["item_id"].nunique()) if "item_id" in sub else np.nan,
                      coverage=covered / len(sub), coverage_low=low, coverage_high=high,
                      uncovered_at_rounding=int(rounding.sum()),
                      wald_coverage=float(np.nanmean(sub["wald_coverage"])) if sub["wald_coverage"].notna().any() else np.nan,
                      median_rel_width=float(np.nanmedian(sub["rel_cert"])),
                      spearman=spearman(c, e))
        if calibrated:
            cal = sub["cert_calibrated"].to_numpy(float)
            good = np.isfinite(cal)
            hit = float((e[good] <= cal[good]).sum())
            low, high = wilson_interval(hit, int(good.sum()))
            with np.errstate(invalid="ignore", divide="ignore"):  # cal/‖ô‖ = rel_cert · cal/ε̂ (0 where both are 0)
                rel_cal = np.where(c > 0, rel * cal / np.where(c > 0, c, 1.0), np.where(cal > 0, np.inf, 0.0))
            record.update(coverage_calibrated=hit / good.sum() if good.any() else np.nan,
                          coverage_calibrated_low=low, coverage_calibrated_high=high,
                          median_rel_width_calibrated=float(np.median(rel_cal[good])) if good.any() else np.nan,
                          spearman_calibrated=spearman(cal[good], e[good]))
        out.append(record)
    return pd.DataFrame(out)

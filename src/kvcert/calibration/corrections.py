"""The two corrections of ε̂ and the quantities they act on.

``design_factor``: the data-free inflation by the effective number of sampled terms. ``conformal_quantile``:
the split-conformal quantile a fit multiplies the base certificate by, with the levels and prompt counts it
needs. ``base_certificate`` and ``output_norm`` read, from step rows, the base and ‖ô‖ both corrections use.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

DESIGN_Z = 2.0  # the design-based inflation's z (see ``design_factor``)
# Float32 rounding: the compressed and the full path differ by up to ~1e-6 ‖ô‖ even where nothing was
# evicted from a layer's view (e.g. a sliding-window layer whose window was kept whole, where ε̂ = 0). A
# calibrated certificate never claims less than this; the per-layer table counts such rows apart.
ROUNDING = 1e-5


def design_factor(tail_ess: np.ndarray, z: float = DESIGN_Z) -> np.ndarray:
    """The design-based inflation of ε̂: √(1 + z/√n_eff) for n_eff = ``tail_ess`` > 0, else 1.

    V̂ is a sum over the sampled slots; with n_eff effective terms its relative standard error is about
    1/√n_eff, so V̂(1 + z/√n_eff) is a one-sided z upper bound on the variance (at most √(1+z) in width,
    when one slot carries all the weight). Needs no calibration data. tail_ess: any shape; NaN stays NaN.
    """
    n = np.asarray(tail_ess, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.sqrt(1.0 + z / np.sqrt(np.where(n > 0, n, 1.0))), np.where(np.isnan(n), np.nan, 1.0))


def minimum_prompts(level: float) -> int:
    """The fewest calibration prompts for which the prompt-exchangeable quantile at ``level`` is finite."""
    return math.ceil(level / (1.0 - level) - 1e-9)


def default_level(delta: float) -> float:
    """The level a calibration aims at unless told otherwise: 1 − δ/5 (0.99 at δ = 0.05).

    Conformal coverage at level L is L in expectation over calibration sets; the coverage of one fitted file
    scatters around it (tens of prompts, whose rows move together), and the worst of a model's layers falls
    below L by more than that scatter's typical size. 1 − δ/2 kept every layer at 1 − δ − 0.01 on the model
    it was chosen on but not on a second architecture with a flat π; 1 − δ/5 is the smallest level of the
    cross-fitted studies that does on both (docs/CALIBRATION-LEVEL.md: the rule, written before its check).
    """
    return 1.0 - float(delta) / 5.0


def needed_prompts(level: float, unit: str, delta: float) -> int:
    """The fewest calibration prompts a fit accepts: with ``unit=prompt``, those that make its quantile finite
    (``minimum_prompts(level)``); with ``unit=row``, those with which even the prompt-level quantile at 1 − δ
    would be (19 at δ = 0.05), so that no calibration rests on a handful of prompts."""
    return minimum_prompts(level if unit == "prompt" else 1.0 - float(delta))


def conformal_quantile(scores: np.ndarray, level: float, groups: np.ndarray | None = None) -> float:
    """The split-conformal quantile of ``scores`` at ``level`` (+inf when the data cannot give one).

    groups None (rows exchangeable): the ⌈(N+1)·level⌉-th smallest of the N scores; a new exchangeable row's
    score is at most it with probability ≥ level. groups (one label per row; prompts exchangeable, rows
    within a prompt not): each of the m groups weighs 1/(m+1), spread evenly over its rows, and the new
    prompt's 1/(m+1) sits at +inf; the smallest t whose weight at or below reaches ``level`` is returned.
    Then the expected fraction of a new prompt's rows with score ≤ t is ≥ level, however its rows depend
    on each other (finite only with m ≥ ``minimum_prompts(level)``). scores: (N,), NaN-free, may hold +inf.
    """
    scores = np.asarray(scores, dtype=float)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level} must lie in (0, 1)")
    if scores.size == 0:
        return math.inf
    order = np.argsort(scores, kind="stable")
    if groups is None:
        rank = math.ceil((scores.size + 1) * level)
        return float(scores[order[rank - 1]]) if rank <= scores.size else math.inf
    _, index, counts = np.unique(np.asarray(groups), return_inverse=True, return_counts=True)
    weights = 1.0 / (counts[index] * (len(counts) + 1.0))
    cumulative = np.cumsum(weights[order])
    reached = np.nonzero(cumulative >= level - 1e-12)[0]
    return float(scores[order[reached[0]]]) if reached.size else math.inf


def base_certificate(steps: pd.DataFrame, base: str) -> np.ndarray:
    """What a conformal factor multiplies, (N,): ε̂ (``base="paper"``) or ε̂ · ``design_factor``
    (``base="design"``); NaN where ε̂ is."""
    cert = steps["cert"].to_numpy(float)
    return cert * design_factor(steps["tail_ess"].to_numpy(float)) if base == "design" else cert


def output_norm(steps: pd.DataFrame) -> np.ndarray:
    """‖ô‖ of every row, (N,): the ``out_norm`` column, or (tables written before it existed) ε̂/rel_cert or
    ‖ô − o‖/rel_err where those are positive, else 0."""
    if "out_norm" in steps:
        return steps["out_norm"].to_numpy(float)
    out = np.zeros(len(steps))
    with np.errstate(invalid="ignore", divide="ignore"):
        for value, relative in (("true_err", "rel_err"), ("cert", "rel_cert")):
            v, r = steps[value].to_numpy(float), steps[relative].to_numpy(float)
            out = np.where((out == 0) & (r > 0) & np.isfinite(v), v / np.where(r > 0, r, 1.0), out)
    return out

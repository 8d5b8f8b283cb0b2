"""Fitting: per-layer conformal factors from oracle step rows (what ``kvcert-calibrate`` writes)."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd

from ..errors import CalibrationError
from .corrections import base_certificate, conformal_quantile, default_level, needed_prompts, output_norm
from .fileformat import BASES, UNITS, Calibration, budget_key
from .ranks import spearman

# τ of the base certificate ε̂ + τ‖ô‖ that a fit tries per layer: 0 keeps ε̂'s shape (where it ranks the error
# well); larger τ lean on ‖ô‖ where ε̂ is near 0 while the error is not (slots the retained set cannot see).
NORM_WEIGHTS = (0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
# A candidate base may rank a layer's calibration errors at most this much worse (Spearman) than ε̂ does.
RANK_TOLERANCE = 0.01
STRATUM_KEYS = ("setting", "policy", "design", "budget")


def fit_calibration(steps: pd.DataFrame, *, model: Mapping, design: Mapping, level: float | None = None,
                    base: str = "paper", unit: str = "row", relative_term: bool = True,
                    never_below_paper: bool = True, fitted_on: Mapping | None = None) -> Calibration:
    """Per-layer conformal factors from oracle step rows (``KEY_COLUMNS`` + ``STEP_COLUMNS``).

    One stratum per (setting, policy, design, budget) with a certificate; within it, per layer
    (``model["num_layers"]`` of them), a base certificate b and the conformal quantile q at ``level``
    (default ``default_level``) of ‖ô − o‖ / b (groups are items when ``unit`` is ``prompt``). b is
    ε̂ (``base="paper"``) or ε̂ · ``design_factor`` (``base="design"``), plus, with ``relative_term``, τ‖ô‖:
    of the candidates τ ∈ ``NORM_WEIGHTS`` and ‖ô‖ alone that rank the layer's calibration errors (Spearman)
    at most ``RANK_TOLERANCE`` worse than ε̂ does, the one whose certificate q · b has the smallest median over
    the layer's calibration rows (τ is chosen on the same rows, which makes the level approximate; the
    held-out coverage is measured in README). ``never_below_paper`` leaves the fit as it is and is recorded in
    the file: the certificate applied is then max(q · b, ε̂) row by row, so that calibration widens the paper's
    certificate where it fails and never narrows it (docs/CALIBRATION-LEVEL.md, *Third confirmation*). Rows
    without a true error (oracle off) or without a certificate are ignored.
    """
    if base not in BASES:
        raise CalibrationError(f"base={base!r} is unknown; known: {list(BASES)}")
    if unit not in UNITS:
        raise CalibrationError(f"unit={unit!r} is unknown; known: {list(UNITS)}")
    level = default_level(design["delta"]) if level is None else float(level)
    if not 0.0 < level < 1.0:
        raise CalibrationError(f"level={level}: must lie in (0, 1)")
    rows = steps[np.isfinite(steps["cert"].to_numpy(float)) & np.isfinite(steps["true_err"].to_numpy(float))]
    if rows.empty:
        raise CalibrationError("no step rows with both a certificate and a true error to calibrate on "
                               "(the oracle must be on and some design must be poisson)")
    n_layers = int(model.get("num_layers") or int(rows["layer"].max()) + 1)
    err, cert, norm = rows["true_err"].to_numpy(float), base_certificate(rows, base), output_norm(rows)
    candidates = [(1.0, tau) for tau in (NORM_WEIGHTS if relative_term else (0.0,))]
    candidates += [(0.0, 1.0)] if relative_term else []
    strata = {}
    for key, index in rows.groupby(list(STRATUM_KEYS), sort=True).indices.items():
        setting, policy, design_name, budget = key
        sub = rows.iloc[index]
        items = sub["item_id"].to_numpy()
        need = needed_prompts(level, unit, design["delta"])
        if len(np.unique(items)) < need:
            raise CalibrationError(
                f"{len(np.unique(items))} calibration prompts for setting={setting} policy={policy} budget={budget:g}: "
                f"unit={unit} at level={level:g} needs at least {need}")
        layers = sub["layer"].to_numpy(int)
        fitted = {"factors": [], "cert_weights": [], "norm_weights": [], "rows": []}
        for layer in range(n_layers):
            mask = layers == layer
            at = index[mask]
            fitted["rows"].append(int(mask.sum()))
            if not mask.any():
                for name, empty in (("factors", None), ("cert_weights", 1.0), ("norm_weights", 0.0)):
                    fitted[name].append(empty)
                continue
            best, floor = None, None
            for weights in candidates:  # the first is ε̂ itself: its rank correlation sets the floor
                b = weights[0] * cert[at] + weights[1] * norm[at]
                rank = spearman(b, err[at], degenerate=-1.0)
                floor = rank - RANK_TOLERANCE if floor is None else floor
                if rank < floor:
                    continue
                q = conformal_quantile(_ratio(err[at], b), level, items[mask] if unit == "prompt" else None)
                width = float(np.median(q * b)) if math.isfinite(q) else math.inf
                if best is None or width < best[0]:
                    best = (width, q, weights)
            if not math.isfinite(best[1]):
                raise CalibrationError(
                    f"layer {layer} of setting={setting} policy={policy} budget={budget:g} has {int(mask.sum())} "
                    f"calibration rows, too few for a finite quantile at level={level:g}; use more prompts")
            fitted["factors"].append(float(best[1]))
            fitted["cert_weights"].append(best[2][0])
            fitted["norm_weights"].append(best[2][1])
        strata[(str(setting), str(policy), str(design_name), budget_key(budget))] = {
            **fitted, "prompts": int(len(np.unique(items)))}
    return Calibration(method="conformal", level=level, base=base, unit=unit, model=dict(model), design=dict(design),
                       strata=strata, fitted_on=dict(fitted_on or {}), never_below_paper=bool(never_below_paper))


def _ratio(err: np.ndarray, cert: np.ndarray) -> np.ndarray:
    """‖ô − o‖ / certificate: 0 where both are 0, +inf where only the certificate is."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(cert > 0, err / np.where(cert > 0, cert, 1.0), np.where(err > 0, np.inf, 0.0))

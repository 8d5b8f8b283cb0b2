"""Applying: the calibrated certificate of a configuration's step rows, checked against the model and knobs
before anything is computed, and its item-level summary."""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import pandas as pd

from .. import run_schema
from ..designs import DesignOptions
from ..errors import CalibrationError
from ..table_columns import CALIBRATED_ITEM_COLUMNS, CALIBRATED_STEP_COLUMNS
from .corrections import ROUNDING, base_certificate, design_factor, output_norm
from .fileformat import DESIGN, Calibration, load_calibration
from .fingerprint import model_identity
from .knobs import design_knobs


def calibrated_certificate(calibration: Calibration | str, steps: pd.DataFrame, *, setting: str, policy: str,
                           design: str, budget: float) -> np.ndarray:
    """cert_calibrated for one configuration's step rows, (N,): NaN where ε̂ is NaN (deterministic designs)."""
    cert = steps["cert"].to_numpy(float)
    if calibration == DESIGN:
        return np.maximum(cert * design_factor(steps["tail_ess"].to_numpy(float)), ROUNDING * output_norm(steps))
    if design != "poisson" or not len(steps):
        return np.full(len(steps), np.nan)
    stratum = calibration.stratum(setting, policy, design, budget)
    factors = np.array([np.nan if f is None else f for f in stratum["factors"]], dtype=float)
    layers = steps["layer"].to_numpy(int)
    if layers.size and layers.max() >= factors.size:
        raise CalibrationError(f"calibration={calibration.source} holds {factors.size} layers; the model has layer "
                               f"{int(layers.max())}")
    cert_w = np.asarray(stratum["cert_weights"], dtype=float)[layers]
    norm_w = np.asarray(stratum["norm_weights"], dtype=float)[layers]
    base, norm = base_certificate(steps, calibration.base), output_norm(steps)
    calibrated = factors[layers] * (cert_w * np.nan_to_num(base) + norm_w * norm)
    if calibration.never_below_paper:
        calibrated = np.maximum(calibrated, np.nan_to_num(cert))
    # ε̂ is NaN exactly where there is no certificate (deterministic rows): keep that NaN whatever the weights
    return np.where(np.isfinite(base), np.maximum(calibrated, ROUNDING * norm), np.nan)


def prepare_calibration(calibration, *, model=None, setting: str, configurations: Iterable[tuple[str, str, float]],
                        options: DesignOptions = DesignOptions(), delta: float = run_schema.DELTA,
                        observation_window: int = run_schema.OBSERVATION_WINDOW,
                        policy_options: Mapping | None = None) -> Calibration | str:
    """Load a ``calibration=`` value and check it, before anything is computed: a file must have been fitted
    on ``model`` (when given) with these knobs, and hold factors for every (policy, design, budget) of
    ``configurations`` that has a certificate. Raises CalibrationError (one line)."""
    calibration = load_calibration(calibration)
    if isinstance(calibration, Calibration):
        if model is not None:
            calibration.check_model(model_identity(model))
        calibration.check_design(design_knobs(options, delta=delta, observation_window=observation_window,
                                              policy_options=policy_options))
        calibration.check_configurations(setting, configurations)
    return calibration


def apply_calibration(calibration, steps: pd.DataFrame, *, model=None, design: str, policy: str, budget: float,
                      setting: str, options: DesignOptions = DesignOptions(), delta: float = run_schema.DELTA,
                      observation_window: int = run_schema.OBSERVATION_WINDOW, policy_options: Mapping | None = None,
                      checked: bool = False) -> pd.DataFrame:
    """``steps`` (one configuration's STEP_COLUMNS rows) with ``CALIBRATED_STEP_COLUMNS`` added.

    calibration: a Calibration, a path to one, or ``design``. Unless ``checked`` (the caller ran
    ``prepare_calibration`` once, as ``generate`` and the cell runner do), it is prepared here first.
    coverage_calibrated is NaN without a true error or a certificate.
    """
    if not checked:
        calibration = prepare_calibration(calibration, model=model, setting=setting,
                                          configurations=[(policy, design, budget)], options=options, delta=delta,
                                          observation_window=observation_window, policy_options=policy_options)
    out = steps.copy()
    cal = calibrated_certificate(calibration, steps, setting=setting, policy=policy, design=design, budget=budget)
    err = steps["true_err"].to_numpy(float) if len(steps) else np.array([])
    with np.errstate(invalid="ignore"):
        covered = np.where(np.isfinite(cal) & np.isfinite(err), (err <= cal).astype(float), np.nan)
    out[CALIBRATED_STEP_COLUMNS[0]] = cal
    out[CALIBRATED_STEP_COLUMNS[1]] = covered
    return out


def calibration_summary(steps: pd.DataFrame) -> dict[str, float]:
    """Item-level ``CALIBRATED_ITEM_COLUMNS`` of one configuration's calibrated step rows: the mean and max of
    the relative calibrated certificate (cert_calibrated/‖ô‖, like ``cert_mean``/``cert_max``) and the
    fraction of rows it covered; NaN where undefined."""
    if not len(steps) or CALIBRATED_STEP_COLUMNS[0] not in steps:
        return dict.fromkeys(CALIBRATED_ITEM_COLUMNS, float("nan"))
    cal, cert = steps["cert_calibrated"].to_numpy(float), steps["cert"].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        relative = steps["rel_cert"].to_numpy(float) * np.where(cert > 0, cal / np.where(cert > 0, cert, 1.0), 1.0)
    relative = relative[np.isfinite(relative)]
    covered = steps["coverage_calibrated"].to_numpy(float)
    covered = covered[np.isfinite(covered)]
    return {"cert_calibrated_mean": float(relative.mean()) if relative.size else float("nan"),
            "cert_calibrated_max": float(relative.max()) if relative.size else float("nan"),
            "coverage_calibrated": float(covered.mean()) if covered.size else float("nan")}

"""Tidy tables of a cell: one row per item × configuration, and one per step × layer × KV head.

Item-level certificate and error columns summarize the step rows of that item and configuration:
``cert_mean`` / ``cert_max`` are the mean / max *relative* certificate ε̂_δ/‖ô‖, ``true_err_mean`` /
``true_err_max`` the mean / max *relative* true error ‖ô − o‖/‖ô‖ (NaN where undefined: the full cache,
deterministic designs for the certificate, oracle off for the error).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..table_columns import CALIBRATED_STEP_COLUMNS, ITEM_COLUMNS, KEY_COLUMNS, STEP_FLOAT32, STEP_INT32


def summarize_steps(steps: pd.DataFrame) -> dict[str, float]:
    """Item-level certificate / error summaries from one configuration's step rows."""

    def stat(column: str, fn) -> float:
        values = steps[column].to_numpy(dtype=float) if len(steps) else np.array([])
        values = values[np.isfinite(values)]
        return float(fn(values)) if values.size else float("nan")

    return {
        "cert_mean": stat("rel_cert", np.mean),
        "cert_max": stat("rel_cert", np.max),
        "true_err_mean": stat("rel_err", np.mean),
        "true_err_max": stat("rel_err", np.max),
    }


def logprob_summary(logprobs: list[float]) -> dict[str, float]:
    values = np.asarray(logprobs, dtype=float)
    return {
        "logprob_mean": float(values.mean()),
        "logprob_min": float(values.min()),
        "logprob_first": float(values[0]),
    }


def empty_step_table() -> pd.DataFrame:
    """A steps table with no rows but every column and dtype (a cell without compressed steps, or one that
    does not store them, still offers the contract's columns to its readers)."""
    frame = pd.DataFrame({c: pd.Series(dtype="str" if c in ("item_id", "policy", "design", "setting") else
                                       "float64" if c == "budget" else "int64" if c == "seed" else "float32")
                          for c in KEY_COLUMNS})
    for column in STEP_INT32:
        frame[column] = pd.Series(dtype="int32")
    for column in STEP_FLOAT32:
        frame[column] = pd.Series(dtype="float32")
    return frame


def tag_steps(steps: pd.DataFrame, keys: dict) -> pd.DataFrame:
    """Prefix a configuration's step rows with its key columns; floats stored as float32."""
    out = steps.copy()
    for column in reversed(KEY_COLUMNS):
        out.insert(0, column, keys[column])
    for column in STEP_FLOAT32 + [c for c in CALIBRATED_STEP_COLUMNS if c in out]:
        out[column] = out[column].astype("float32")
    for column in STEP_INT32:
        out[column] = out[column].astype("int32")
    return out


__all__ = ["ITEM_COLUMNS", "KEY_COLUMNS", "empty_step_table", "logprob_summary", "summarize_steps", "tag_steps"]

"""Tidy tables of a cell: one row per item × configuration, and one per step × layer × KV head.

Item-level certificate and error columns summarize the step rows of that item and configuration:
``cert_mean`` / ``cert_max`` are the mean / max *relative* certificate ε̂_δ/‖ô‖, ``true_err_mean`` /
``true_err_max`` the mean / max *relative* true error ‖ô − o‖/‖ô‖ (NaN where undefined: the full cache,
deterministic designs for the certificate, oracle off for the error).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

ITEM_COLUMNS = [
    "item_id", "task", "policy", "design", "budget", "seed", "setting", "prediction", "score", "correct",
    "logprob_mean", "logprob_min", "logprob_first", "cert_mean", "cert_max", "true_err_mean", "true_err_max",
    "retained_tokens", "context_tokens", "new_tokens", "cache_bytes", "full_bytes", "metric", "model", "data",
]
KEY_COLUMNS = ["item_id", "policy", "design", "budget", "seed", "setting"]
STEP_FLOAT32 = ["trace_var", "cert", "true_err", "rel_cert", "rel_err", "coverage", "wald_coverage"]


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


def tag_steps(steps: pd.DataFrame, keys: dict) -> pd.DataFrame:
    """Prefix a configuration's step rows with its key columns; floats stored as float32."""
    out = steps.copy()
    for column in reversed(KEY_COLUMNS):
        out.insert(0, column, keys[column])
    for column in STEP_FLOAT32:
        out[column] = out[column].astype("float32")
    for column in ("step", "layer", "kv_head"):
        out[column] = out[column].astype("int32")
    return out


def empty_step_table() -> pd.DataFrame:
    """A steps table with no rows but every column and dtype: a cell whose answers all stop at their first
    token has no step attending to a compressed cache, and its table must still concatenate with others."""
    from ..generation import STEP_COLUMNS

    keys = {"item_id": "", "policy": "", "design": "", "budget": 0.0, "seed": 0, "setting": ""}
    return tag_steps(pd.DataFrame({c: pd.Series(dtype="float64") for c in STEP_COLUMNS}), keys)


def unwritable_reason(target: Path) -> str | None:
    """Why ``target`` (a directory to create or use) cannot be written, or None when it can.

    The nearest existing ancestor decides: it must be a writable directory.
    """
    for path in (target, *target.parents):
        if path.exists():
            if not path.is_dir():
                return f"{path} is not a directory"
            if not os.access(path, os.W_OK | os.X_OK):
                return f"{path} is not writable"
            return None
    return None


def write_parquet_atomic(frame: pd.DataFrame, path: str | Path) -> None:
    """Write ``frame`` to a temporary file beside ``path`` and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(text: str, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""Cell tables (the runner's output contract) and the population filters the claims apply.

A cell directory holds ``items.parquet`` (one row per item x configuration) and ``steps.parquet``
(one row per item x configuration x step x layer x KV head). A claim reads several cells and
concatenates them, then keeps only the rows of its pre-registered population.

Units of analysis (pre-registered in claims.yaml ``conventions``):
- the *item* is the resampling cluster; an item is identified by ``UNIT_CANDIDATES`` columns that
  are present (``model`` and ``data`` keep items of different models/shards apart);
- a *run* is one (item, policy, seed) row of a configuration: per-run signals (certificate,
  confidence) are paired with that run's correctness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from kvcert.analysis.errors import AnalysisError

# Columns the analyses read; the runner writes more (prediction, retained_tokens, ...).
REQUIRED = {
    "items": (
        "item_id", "policy", "design", "budget", "seed", "setting", "correct",
        "logprob_mean", "cert_mean", "cert_max",
    ),
    "steps": (
        "item_id", "policy", "design", "budget", "seed", "setting", "step", "layer", "kv_head",
        "trace_var", "true_err", "rel_err", "coverage", "wald_coverage",
    ),
}
UNIT_CANDIDATES = ("model", "data", "task", "item_id")
REFERENCE_POLICY = "full"
BUDGET_ATOL = 1e-6


def load_cells(cell_dirs: Sequence[str | Path], table: str) -> pd.DataFrame:
    """Concatenate ``<cell>/<table>.parquet`` over cells, checking that the needed columns exist."""
    if not cell_dirs:
        raise AnalysisError(f"no cell directories given (need at least one with {table}.parquet)")
    frames = []
    for d in cell_dirs:
        path = Path(d) / f"{table}.parquet"
        if not path.is_file():
            raise AnalysisError(f"{path}: missing (every input cell needs {table}.parquet)")
        try:
            df = pd.read_parquet(path)
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise AnalysisError(f"{path}: unreadable parquet ({type(exc).__name__}: {exc})") from None
        missing = [c for c in REQUIRED[table] if c not in df.columns]
        if missing:
            raise AnalysisError(f"{path}: missing column(s) {', '.join(missing)}")
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    out["budget"] = out["budget"].astype(float)
    return out


def unit_columns(df: pd.DataFrame) -> list[str]:
    """Columns that identify an item (the bootstrap cluster)."""
    return [c for c in UNIT_CANDIDATES if c in df.columns]


def budget_mask(df: pd.DataFrame, budget: float) -> pd.Series:
    return pd.Series(np.isclose(df["budget"].to_numpy(float), float(budget), atol=BUDGET_ATOL), index=df.index)


def select(
    df: pd.DataFrame,
    table: str,
    *,
    setting: str,
    policies: Iterable[str],
    designs: Iterable[str],
    budgets: Iterable[float],
) -> pd.DataFrame:
    """Rows of the population; every (policy, design, budget) combination must be present.

    Missing combinations are an input error (the workflow passed the wrong cells), reported in
    one line naming what is missing.
    """
    policies, designs, budgets = list(policies), list(designs), [float(b) for b in budgets]
    in_setting = df["setting"] == setting
    if not in_setting.any():
        present = sorted(map(str, df["setting"].unique()))
        raise AnalysisError(f"{table}.parquet: no rows with setting={setting} (cells have settings {present})")
    keep = pd.Series(False, index=df.index)
    missing = []
    for p in policies:
        for d in designs:
            for b in budgets:
                m = in_setting & (df["policy"] == p) & (df["design"] == d) & budget_mask(df, b)
                if not m.any():
                    missing.append(f"policy={p} design={d} budget={b:g}")
                keep |= m
    if missing:
        raise AnalysisError(f"{table}.parquet: no rows for setting={setting} " + "; ".join(missing))
    return df.loc[keep].copy()


def reference(items: pd.DataFrame, setting: str) -> pd.Series:
    """Full-cache correctness per item (mean over duplicate full rows), the 'cache-induced' reference.

    Full rows of the same setting are preferred; the full-cache answer does not depend on when
    compression would have happened, so full rows of any setting are used if that setting has none.
    """
    full = items[items["policy"] == REFERENCE_POLICY]
    if full.empty:
        raise AnalysisError(f"items.parquet: no full-cache rows (policy={REFERENCE_POLICY}) in the cells")
    same = full[full["setting"] == setting]
    full = same if not same.empty else full
    return full.groupby(unit_columns(items))["correct"].apply(lambda s: s.astype(float).mean())


def per_unit_mean(df: pd.DataFrame, column: str) -> pd.Series:
    """Mean of a column per item (averages seeds: the item is the unit for accuracy)."""
    return df.groupby(unit_columns(df))[column].apply(lambda s: s.astype(float).mean())


def runs(df: pd.DataFrame, signals: dict[str, str]) -> pd.DataFrame:
    """One row per run with float ``correct`` and the named signal columns (renamed).

    ``signals`` maps an output name to ``column`` or ``-column`` (negated: e.g. low confidence
    signals failure). Runs with a NaN signal are dropped; the count is kept in ``attrs``.
    """
    units = unit_columns(df)
    out = df[units + ["policy", "seed"]].copy()
    out["correct"] = df["correct"].astype(float).to_numpy()
    for name, col in signals.items():
        sign = -1.0 if col.startswith("-") else 1.0
        out[name] = sign * df[col.lstrip("-")].astype(float).to_numpy()
    finite = np.isfinite(out[list(signals)].to_numpy(float)).all(axis=1)
    dropped = int((~finite).sum())
    out = out.loc[finite].reset_index(drop=True)
    out.attrs["n_dropped_nan_signal"] = dropped
    return out


def cluster_index(df: pd.DataFrame, units: list[str] | None = None) -> tuple[np.ndarray, int]:
    """Integer item index (0..n_items-1) of every row, and the number of items."""
    units = units or unit_columns(df)
    codes = df.groupby(units, sort=True).ngroup().to_numpy()
    return codes, int(codes.max()) + 1 if len(codes) else 0


def describe(df: pd.DataFrame) -> dict:
    """Models and data shards present (recorded in the claim's details, not filtered on)."""
    return {c: sorted(map(str, df[c].dropna().unique())) for c in ("model", "data") if c in df.columns}

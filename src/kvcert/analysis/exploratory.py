"""Readers for exploratory analyses (certified budgets, held-out checks).

The claims read cells through :func:`kvcert.analysis.data.load_cells`, which the pre-registration locks with the
columns the claims need (``data.REQUIRED``). An exploratory analysis reads other columns and tables (a target
cell's ``targets``), so it names its own columns here instead of widening the locked reader.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pandas as pd

from kvcert.analysis.errors import AnalysisError


def load_cell_table(cell_dirs: Sequence[str | Path], table: str, required: Sequence[str]) -> pd.DataFrame:
    """Concatenate ``<cell>/<table>.parquet`` over cells, checking that the ``required`` columns exist.

    Returns one frame, rows in cell order; ``budget`` (when present) as float, as the claims' reader does.
    Raises AnalysisError naming the file for a missing, unreadable or incomplete table."""
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
        missing = [c for c in required if c not in df.columns]
        if missing:
            raise AnalysisError(f"{path}: missing column(s) {', '.join(missing)}")
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    if "budget" in out.columns:
        out["budget"] = out["budget"].astype(float)
    return out


def read_study_table(path: str | Path, required: Sequence[str], made_by: str) -> pd.DataFrame:
    """A study's CSV table (an exploratory figure's input), checking that the ``required`` columns exist.
    Raises AnalysisError naming the file where it is missing (``made_by``: what writes it) or lacks a column."""
    path = Path(path)
    if not path.is_file():
        raise AnalysisError(f"{path}: missing ({made_by} writes it)")
    table = pd.read_csv(path)
    missing = [c for c in required if c not in table.columns]
    if missing:
        raise AnalysisError(f"{path}: no column {', '.join(missing)}")
    return table

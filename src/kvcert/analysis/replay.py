"""Replays of decision policies from stored runs (no model re-run needed).

Every configuration was run once per item and stored, so a gate that chooses, per run, between
the run's own answer and a better one (a higher-budget run for escalation, the full cache for
recompute) is replayed exactly:

    accuracy(signal, q) = mean over runs of  low + fired(signal, q) * (better - low)

where ``fired`` selects the top fraction q of runs by the signal (ties share the quota, see
``stats.TopFraction``). Random gating is the same formula with a constant signal, which gives
``fired = q`` for every run: its exact expectation ``mean(low) + q * mean(better - low)``.
All quantities are in accuracy points (0-100). Weights are item multiplicities from the bootstrap;
runs inherit their item's weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvcert.analysis import data
from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.stats import TopFraction

RANDOM = "random"


@dataclass
class Replay:
    """Per-run outcomes without (``low``) and with (``better``) the intervention, and signals."""

    low: np.ndarray
    better: np.ndarray
    signals: dict[str, np.ndarray]
    cluster: np.ndarray
    n_clusters: int
    n_unmatched_runs: int = 0  # runs without a counterpart (reported in the claim's details)
    _top: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        # A constant signal is random gating in expectation (all runs tie at the boundary).
        self.signals = {**self.signals, RANDOM: np.zeros(len(self.low))}

    def accuracy(self, signal: str, q: float, W: np.ndarray | None = None) -> np.ndarray:
        """Accuracy (points) after intervening on the top-q runs by ``signal``; shape (B,)."""
        W = np.ones((1, self.n_clusters)) if W is None else np.atleast_2d(W)
        Wr = W[:, self.cluster]
        top = self._top.setdefault(signal, TopFraction(self.signals[signal]))
        fired = top(q, Wr)
        value = self.low + fired * (self.better - self.low)
        return 100.0 * (Wr * value).sum(axis=1) / Wr.sum(axis=1)

    def curve(self, signal: str, fractions) -> list[float]:
        """Point-estimate accuracy for each intervention fraction (for figures and details)."""
        return [float(self.accuracy(signal, float(q))[0]) for q in fractions]


def _build(runs: pd.DataFrame, better: pd.Series, keys: list[str], signals: list[str], what: str) -> Replay:
    merged = runs.merge(better.rename("better").reset_index(), on=keys, how="inner")
    if merged.empty:
        raise AnalysisError(f"{what}: no run has a matching {what.split()[0]} counterpart for the same item")
    cluster, n = data.cluster_index(merged, data.unit_columns(runs))
    return Replay(
        low=merged["correct"].to_numpy(float),
        better=merged["better"].to_numpy(float),
        signals={s: merged[s].to_numpy(float) for s in signals},
        cluster=cluster,
        n_clusters=n,
        n_unmatched_runs=int(len(runs) - len(merged)),
    )


def escalation(low_runs: pd.DataFrame, high_items: pd.DataFrame, signals: list[str]) -> Replay:
    """Budget escalation: a fired low-budget run takes the high-budget outcome of the same item
    and policy (its mean over the high-budget seeds: the expected escalated answer)."""
    keys = data.unit_columns(low_runs) + ["policy"]
    high = high_items.assign(correct=high_items["correct"].astype(float)).groupby(keys)["correct"].mean()
    return _build(low_runs, high, keys, signals, "high-budget escalation")


def recompute(runs: pd.DataFrame, full: pd.Series, signals: list[str]) -> Replay:
    """Recompute: a fired compressed run takes the item's full-cache outcome."""
    keys = data.unit_columns(runs)
    return _build(runs, full, keys, signals, "full-cache recompute")

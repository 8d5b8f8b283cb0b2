"""The public building blocks of a claim analysis: what a named variant (kvcert.analysis.registry) composes.

Version 1's frozen module (kvcert.analysis.claims) keeps these as private helpers, and its lock forbids
renaming them there; this module gives each a public, documented name that delegates to the frozen helper,
so that a variant computes exactly what the frozen claims compute and never reaches into a private name.
Modules frozen before this one (amendment2.py, variants.py) still call the private names: they are kept as
they were locked.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from kvcert.analysis import claims, replay, verdicts
from kvcert.analysis.claims import ClaimResult, Options
from kvcert.analysis.stats import Interval

# The interval of a statistic that cannot be computed (e.g. an AUC without failing runs): NaN, no replicates.
UNDEFINED: Interval = claims._UNDEFINED


def runs(selected: pd.DataFrame, conventions: dict) -> tuple[pd.DataFrame, list[str]]:
    """One row per run of ``selected`` (an items table already filtered to a claim's population) with its signals
    as columns: ``certificate`` and ``confidence`` (negated, so that high means suspect), plus ``certificate_max``
    when the secondary certificate is finite on every run. Returns (runs, signal names); a population whose every
    run has a NaN signal is an AnalysisError."""
    return claims._runs(selected, conventions)


def rule(spec: dict, component: str) -> dict:
    """The decision rule (threshold, direction, null margin, ...) of ``component`` of a claim's spec; a component the
    spec lacks is an AnalysisError naming the claim."""
    return claims._rule(spec, component)


def finish(spec: dict, components: list[verdicts.Component], n_clusters: int, details: dict,
           figure_data: dict | None = None) -> ClaimResult:
    """The ClaimResult of decided ``components``: the verdict rule combines them, the binding component gives the
    estimate, interval and threshold, ``n_clusters`` items were resampled; ``details`` follow the components."""
    return claims._finish(spec, components, n_clusters, details, figure_data)


def bootstrap(statistic: Callable[[np.ndarray], np.ndarray], n_clusters: int, opts: Options,
              rows_per_cluster: float = 1.0) -> list[Interval]:
    """Percentile intervals of ``statistic`` under the item (cluster) bootstrap of ``opts``.

    statistic: W (B, n_clusters) multiplicities -> (B, k) values; returns k Intervals, in column order."""
    return claims._boot(statistic, n_clusters, opts, rows_per_cluster)


def replay_intervals(rep: replay.Replay, rate: float, opts: Options) -> dict[str, Interval]:
    """A replay's gains and accuracies at intervention rate ``rate``, bootstrapped: gain_over_random,
    gain_over_confidence, accuracy_certificate, accuracy_confidence, accuracy_random, accuracy_without,
    accuracy_all (points)."""
    return claims._replay_intervals(rep, rate, opts)


def curves(rep: replay.Replay, grid) -> dict:
    """Accuracy (points) of a replay at every rate of ``grid``, for the certificate, confidence and random gates."""
    return claims._curves(rep, grid)

"""Named analysis variants an amendment selects by name, instead of copying a claims module.

An amendment that changes one piece of analysis says so in its document, e.g. amendment 4's

    analysis:
      c5_gating: within_model

and ``with_variants`` returns the frozen base analysis (registry and ``run_claim``) with the claims those
choices name replaced by the functions registered here; every other claim is the base code, unchanged. The
choice (``c5_gating``) names the claim it replaces (``CLAIM_OF``); the value names the function. This module is
frozen by the lock of the first amendment that selects from it (amendment 4); a later amendment adds its
variants in a module of its own rather than editing this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvcert.analysis import claims, data, replay, verdicts
from kvcert.analysis.claims import ClaimDef, ClaimResult, Options, Tables
from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.stats import TopFraction

MODEL = "model"  # the items table's column that names a run's model


@dataclass
class WithinGroupReplay(replay.Replay):
    """A replay whose gates fire for the top fraction q of runs of each group separately.

    group: (n_runs,) integer group of every run (the model). Random gating is unchanged: a constant signal
    fires q of every run, within each group as in the pool.
    """

    group: np.ndarray | None = None

    def accuracy(self, signal: str, q: float, W: np.ndarray | None = None) -> np.ndarray:
        """Accuracy (points) after intervening on the top-q runs of each group by ``signal``; shape (B,)."""
        W = np.ones((1, self.n_clusters)) if W is None else np.atleast_2d(W)
        Wr = W[:, self.cluster]
        fired = np.zeros_like(Wr, dtype=float)
        for g in np.unique(self.group):
            rows = self.group == g
            # One TopFraction per (signal, group): its sort is done once for every bootstrap replicate.
            top = self._top.setdefault((signal, int(g)), TopFraction(self.signals[signal][rows]))
            fired[:, rows] = top(q, Wr[:, rows])
        value = self.low + fired * (self.better - self.low)
        return 100.0 * (Wr * value).sum(axis=1) / Wr.sum(axis=1)


def escalation_within_model(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C5 with the gate ranking certificates within each model (amendment 4's ``c5_gating: within_model``).

    Population, runs, escalated outcome, random gating, bootstrap, components and decision rule are version 1's
    (``claims.claim_escalation``); only the set of fired runs differs: the top escalation_rate of each model's
    runs by the signal, instead of the top escalation_rate of all runs pooled.
    """
    pop = claims.population(spec, opts.scale)
    low_b, high_b, q = float(pop["low_budget"]), float(pop["high_budget"]), float(pop["escalation_rate"])
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=[low_b, high_b])
    if MODEL not in sel.columns:
        raise AnalysisError(f"items.parquet: no {MODEL!r} column, so C5's gate cannot rank within each model")
    r, _ = claims._runs(sel[data.budget_mask(sel, low_b)], conv)
    models = sorted(map(str, r[MODEL].unique()))
    # The model rides through the replay's merge as one more per-run signal, so it stays aligned with its run.
    r["_model_code"] = r[MODEL].astype(str).map({m: i for i, m in enumerate(models)}).astype(float)
    base = replay.escalation(r, sel[data.budget_mask(sel, high_b)], ["certificate", "confidence", "_model_code"])
    group = base.signals.pop("_model_code").astype(int)
    base.signals.pop(replay.RANDOM)  # re-added by the subclass's __post_init__
    rep = WithinGroupReplay(low=base.low, better=base.better, signals=base.signals, cluster=base.cluster,
                            n_clusters=base.n_clusters, n_unmatched_runs=base.n_unmatched_runs, group=group)
    ivs = claims._replay_intervals(rep, q, opts)
    comps = [verdicts.decide("gain_over_random", ivs["gain_over_random"], claims._rule(spec, "gain_over_random"))]
    curves = claims._curves(rep, spec.get("secondary", {}).get("rate_grid", [0.0, q, 1.0]))
    details = {**{k: v.as_dict() for k, v in ivs.items()},
               "escalation_rate": q, "gating": "within_model", "gated_models": models,
               "n_runs": int(len(rep.low)), "n_runs_unmatched": rep.n_unmatched_runs,
               "n_runs_by_model": {m: int((group == i).sum()) for i, m in enumerate(models)},
               "curve": curves, **data.describe(sel)}
    return claims._finish(spec, comps, rep.n_clusters, details,
                          {"curve": curves, "rate": q, "xlabel": "escalation rate (within each model)",
                           "title": "budget escalation"})


# choice -> {value: the claim function}; the claim a choice replaces is CLAIM_OF[choice].
VARIANTS: dict[str, dict[str, ClaimDef]] = {
    "c5_gating": {"within_model": ClaimDef(escalation_within_model, ("items",))},
}
CLAIM_OF = {"c5_gating": "c5"}


def with_variants(registry: dict[str, ClaimDef], run_claim: Callable, choices: dict | None, where: str):
    """(registry, run_claim) of the base analysis with the claims named by ``choices`` replaced.

    choices: an amendment's ``analysis`` mapping (None or empty: the base analysis itself); where: the
    document it comes from, named in errors.
    """
    if not choices:
        return registry, run_claim
    if not isinstance(choices, dict):
        raise AnalysisError(f"{where}: analysis={choices!r}: expected a mapping such as {{c5_gating: within_model}}")
    replaced: dict[str, ClaimDef] = {}
    for choice, name in choices.items():
        if choice not in VARIANTS:
            raise AnalysisError(f"{where}: analysis.{choice}: unknown; known: {', '.join(sorted(VARIANTS))}")
        if name not in VARIANTS[choice]:
            raise AnalysisError(f"{where}: analysis.{choice}={name!r}: unknown; known: "
                                f"{', '.join(sorted(VARIANTS[choice]))}")
        replaced[CLAIM_OF[choice]] = VARIANTS[choice][name]
    chosen = {CLAIM_OF[c]: {c: n} for c, n in choices.items()}

    def run(claim_id: str, tables: Tables, spec: dict, conventions: dict, opts: Options) -> ClaimResult:
        if claim_id not in replaced:
            return run_claim(claim_id, tables, spec, conventions, opts)
        result = replaced[claim_id].fn(tables, spec, conventions, opts)
        prereg_boot = int(spec.get("test", {}).get("n_boot", conventions.get("n_boot", 2000)))
        result.details["run"] = {
            "scale": opts.scale, "n_boot": opts.n_boot, "seed": opts.seed, "alpha": opts.alpha,
            "n_boot_below_preregistered": opts.n_boot < prereg_boot,
        }
        result.details["analysis_variant"] = chosen[claim_id]
        return result

    return {**registry, **replaced}, run

"""C4 and C6, the claims that rank runs by an AUC, parametrized by the AUC method (``AUC_METHODS``).

Version 1 (kvcert.analysis.claims) computes these AUCs with its own Mann-Whitney statistic; amendment 2
(kvcert.analysis.amendment2, frozen) copied both claims to swap in scikit-learn's. Here each claim is written once
and takes the method by name: ``mann_whitney`` (version 1's stats.auc and stats.roc_curve) or ``sklearn``
(amendment 2's public weighted_auc and scikit-learn's roc_curve, imported only when asked for). Populations, runs,
signals, bootstrap, components, details and decision rules are version 1's. tests/test_discrimination.py shows
that ``prediction(m)`` and ``attribution(m)`` give the frozen modules' claim JSONs on the same tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvcert.analysis import data, parts, stats, verdicts
from kvcert.analysis.claims import ClaimResult, Options, Tables, population


@dataclass(frozen=True)
class AucMethod:
    """auc(scores (n,), labels (n,) bool, weights (B, n)) -> (B,) AUCs (NaN where a class has no weight);
    roc(scores (n,), labels (n,)) -> {"fpr": (k,), "tpr": (k,)}, the figure's curve."""

    auc: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    roc: Callable[[np.ndarray, np.ndarray], dict]


def _mann_whitney() -> AucMethod:
    def roc(scores, labels) -> dict:
        fpr, tpr = stats.roc_curve(scores, labels)
        return {"fpr": fpr, "tpr": tpr}

    return AucMethod(stats.auc, roc)


def _sklearn() -> AucMethod:
    from sklearn.metrics import roc_curve

    from kvcert.analysis import amendment2

    def roc(scores, labels) -> dict:
        labels = np.asarray(labels, dtype=bool)
        if labels.all() or not labels.any():  # one class: scikit-learn's curve is undefined; draw the diagonal
            return {"fpr": np.array([0.0, 1.0]), "tpr": np.array([0.0, 1.0])}
        fpr, tpr, _ = roc_curve(labels, scores)
        return {"fpr": fpr, "tpr": tpr}

    return AucMethod(amendment2.weighted_auc, roc)


# name -> a loader of the method (loaders, so that scikit-learn loads only when a version asks for it).
AUC_METHODS: dict[str, Callable[[], AucMethod]] = {"mann_whitney": _mann_whitney, "sklearn": _sklearn}


def prediction(method: str):
    """The C4 claim function with AUC method ``method``: AUC(certificate) - AUC(confidence) for predicting
    failure under eviction."""
    auc = AUC_METHODS[method]()

    def claim_prediction(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
        pop = population(spec, opts.scale)
        sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                          designs=pop["designs"], budgets=pop["budgets"])
        r, names = parts.runs(sel, conv)
        fail = r["correct"].to_numpy(float) < 0.5
        cluster, n = data.cluster_index(r)
        scores = {s: r[s].to_numpy(float) for s in names}

        def stat(W):
            Wr = W[:, cluster]
            a = {s: auc.auc(scores[s], fail, Wr) for s in names}
            return np.column_stack([a["certificate"] - a["confidence"]] + [a[s] for s in names])

        ivs = parts.bootstrap(stat, n, opts, len(r) / n)
        comps = [verdicts.decide("auc_difference", ivs[0], parts.rule(spec, "auc_difference"))]
        details = {
            **{f"auc_{s}": iv.as_dict() for s, iv in zip(names, ivs[1:])},
            "n_runs": int(len(r)), "n_failures": int(fail.sum()), "n_successes": int((~fail).sum()),
            "n_runs_dropped_nan_signal": r.attrs.get("n_dropped_nan_signal", 0),
            **data.describe(sel),
        }
        figure = {"roc": {s: auc.roc(scores[s], fail) for s in names},
                  "title": "failure prediction", "positive": "failure"}
        return parts.finish(spec, comps, n, details, figure)

    return claim_prediction


def attribution(method: str):
    """The C6 claim function with AUC method ``method``: among failing runs, the certificate's AUC for
    cache-induced vs inherent failure, and its difference from the confidence's."""
    auc = AUC_METHODS[method]()

    def claim_attribution(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
        pop = population(spec, opts.scale)
        sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                          designs=pop["designs"], budgets=pop["budgets"])
        full = data.reference(tables.items, pop["setting"]).rename("full_correct").reset_index()
        r, names = parts.runs(sel, conv)
        r = r.merge(full, on=data.unit_columns(r), how="inner")
        failing = r[r["correct"] < 0.5].reset_index(drop=True)
        cache_induced = failing["full_correct"].to_numpy(float) >= 0.5
        cluster, n = data.cluster_index(failing)
        scores = {s: failing[s].to_numpy(float) for s in names}
        others = [s for s in names if s != "certificate"]

        def stat(W):
            Wr = W[:, cluster]
            a = {s: auc.auc(scores[s], cache_induced, Wr) for s in names}
            return np.column_stack([a["certificate"], a["certificate"] - a["confidence"]] + [a[s] for s in others])

        # No failing run (possible with a handful of items): the AUCs are undefined -> inconclusive.
        ivs = parts.bootstrap(stat, n, opts, len(failing) / n) if n else [parts.UNDEFINED] * (len(names) + 1)
        comps = [verdicts.decide("auc_certificate", ivs[0], parts.rule(spec, "auc_certificate")),
                 verdicts.decide("auc_difference", ivs[1], parts.rule(spec, "auc_difference"))]
        details = {
            "auc_certificate": ivs[0].as_dict(),
            **{f"auc_{s}": iv.as_dict() for s, iv in zip(others, ivs[2:])},
            "n_failing_runs": int(len(failing)), "n_cache_induced": int(cache_induced.sum()),
            "n_inherent": int((~cache_induced).sum()),
            "n_runs_without_full_row": int(len(sel) - len(r) - r.attrs.get("n_dropped_nan_signal", 0)),
            **data.describe(sel),
        }
        figure = {"roc": {s: auc.roc(scores[s], cache_induced) for s in names},
                  "title": "attribution among failures", "positive": "cache-induced"}
        return parts.finish(spec, comps, n, details, figure)

    return claim_attribution



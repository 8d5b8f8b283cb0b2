"""Amendment 2's analysis code: C4 and C6 compute their AUCs and ROC curves with scikit-learn.

Everything else is version 1's code (``kvcert.analysis.claims``), unchanged: the registry below takes
C1, C2, C3, C5 and C7 from it as they are. C4 and C6 keep version 1's populations, runs, signals,
bootstrap, components and decision rules; only the AUC (``roc_auc_score`` with the bootstrap
multiplicities as sample weights, which equals the Mann-Whitney AUC of the expanded sample, ties counted
half) and the ROC points of the figures (``roc_curve``) come from scikit-learn, the field's standard
implementation. tests/test_amendment2.py shows that both give version 1's numbers on version 1's data.
Frozen by ``preregistration/amendment-2.lock``.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve

from kvcert.analysis import claims, data, verdicts
from kvcert.analysis.claims import ClaimDef, ClaimResult, Options, Tables


def weighted_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUC of ``scores`` for boolean ``labels`` under each row of ``weights`` (B, n) -> (B,); NaN where a
    class has no weight (the AUC is then undefined)."""
    labels = np.asarray(labels, dtype=bool)
    out = np.full(weights.shape[0], np.nan)
    for b, w in enumerate(np.atleast_2d(weights)):
        if (w * labels).sum() > 0 and (w * ~labels).sum() > 0:
            keep = w > 0
            out[b] = roc_auc_score(labels[keep], scores[keep], sample_weight=w[keep])
    return out


def _roc(scores, labels) -> dict:
    labels = np.asarray(labels, dtype=bool)
    if labels.all() or not labels.any():
        return {"fpr": np.array([0.0, 1.0]), "tpr": np.array([0.0, 1.0])}
    fpr, tpr, _ = roc_curve(labels, scores)
    return {"fpr": fpr, "tpr": tpr}


def claim_prediction(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C4: AUC(certificate) - AUC(confidence) for predicting failure under eviction (scikit-learn AUC)."""
    pop = claims.population(spec, opts.scale)
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    r, names = claims._runs(sel, conv)
    fail = r["correct"].to_numpy(float) < 0.5
    cluster, n = data.cluster_index(r)
    scores = {s: r[s].to_numpy(float) for s in names}

    def stat(W):
        Wr = W[:, cluster]
        a = {s: weighted_auc(scores[s], fail, Wr) for s in names}
        return np.column_stack([a["certificate"] - a["confidence"]] + [a[s] for s in names])

    ivs = claims._boot(stat, n, opts, len(r) / n)
    comps = [verdicts.decide("auc_difference", ivs[0], claims._rule(spec, "auc_difference"))]
    details = {
        **{f"auc_{s}": iv.as_dict() for s, iv in zip(names, ivs[1:])},
        "n_runs": int(len(r)), "n_failures": int(fail.sum()), "n_successes": int((~fail).sum()),
        "n_runs_dropped_nan_signal": r.attrs.get("n_dropped_nan_signal", 0),
        **data.describe(sel),
    }
    figure = {"roc": {s: _roc(scores[s], fail) for s in names}, "title": "failure prediction", "positive": "failure"}
    return claims._finish(spec, comps, n, details, figure)


def claim_attribution(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C6: among failing runs, the certificate's AUC for cache-induced vs inherent failure (scikit-learn AUC)."""
    pop = claims.population(spec, opts.scale)
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    full = data.reference(tables.items, pop["setting"]).rename("full_correct").reset_index()
    r, names = claims._runs(sel, conv)
    r = r.merge(full, on=data.unit_columns(r), how="inner")
    failing = r[r["correct"] < 0.5].reset_index(drop=True)
    cache_induced = failing["full_correct"].to_numpy(float) >= 0.5
    cluster, n = data.cluster_index(failing)
    scores = {s: failing[s].to_numpy(float) for s in names}
    others = [s for s in names if s != "certificate"]

    def stat(W):
        Wr = W[:, cluster]
        a = {s: weighted_auc(scores[s], cache_induced, Wr) for s in names}
        return np.column_stack([a["certificate"], a["certificate"] - a["confidence"]] + [a[s] for s in others])

    # No failing run (possible with a handful of items): the AUCs are undefined -> inconclusive.
    ivs = claims._boot(stat, n, opts, len(failing) / n) if n else [claims._UNDEFINED] * (len(names) + 1)
    comps = [verdicts.decide("auc_certificate", ivs[0], claims._rule(spec, "auc_certificate")),
             verdicts.decide("auc_difference", ivs[1], claims._rule(spec, "auc_difference"))]
    details = {
        "auc_certificate": ivs[0].as_dict(),
        **{f"auc_{s}": iv.as_dict() for s, iv in zip(others, ivs[2:])},
        "n_failing_runs": int(len(failing)), "n_cache_induced": int(cache_induced.sum()),
        "n_inherent": int((~cache_induced).sum()),
        "n_runs_without_full_row": int(len(sel) - len(r) - r.attrs.get("n_dropped_nan_signal", 0)),
        **data.describe(sel),
    }
    figure = {"roc": {s: _roc(scores[s], cache_induced) for s in names},
              "title": "attribution among failures", "positive": "cache-induced"}
    return claims._finish(spec, comps, n, details, figure)


def run_claim(claim_id: str, tables: Tables, spec: dict, conventions: dict, opts: Options) -> ClaimResult:
    """Version 1's ``claims.run_claim``, with C4 and C6 taken from this module."""
    if claim_id not in ("c4", "c6"):
        return claims.run_claim(claim_id, tables, spec, conventions, opts)
    result = REGISTRY[claim_id].fn(tables, spec, conventions, opts)
    prereg_boot = int(spec.get("test", {}).get("n_boot", conventions.get("n_boot", 2000)))
    result.details["run"] = {
        "scale": opts.scale, "n_boot": opts.n_boot, "seed": opts.seed, "alpha": opts.alpha,
        "n_boot_below_preregistered": opts.n_boot < prereg_boot,
    }
    return result


REGISTRY: dict[str, ClaimDef] = {
    **claims.REGISTRY,
    "c4": ClaimDef(claim_prediction, ("items",)),
    "c6": ClaimDef(claim_attribution, ("items",)),
}

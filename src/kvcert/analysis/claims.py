"""The seven pre-registered claims: one function per claim, registered by id.

Each function takes the cell tables, the claim's entry of claims.yaml (with the file's
``conventions``) and run options, filters the pre-registered population, computes the tested
components with a paired item-cluster bootstrap, applies the frozen decision rule and returns a
``ClaimResult``. Secondary numbers go to ``details``; arrays only a figure needs go to
``figure_data`` (not serialized).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import pandas as pd

from kvcert.analysis import data, replay, verdicts
from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.stats import Interval, Median, Spearman, auc, cluster_bootstrap, roc_curve, weighted_mean


# --- result and inputs -------------------------------------------------------------------------


@dataclass
class ClaimResult:
    """What a claim analysis reports (one row of the claims table, plus details)."""

    claim: str
    title: str
    estimate: float
    ci_low: float
    ci_high: float
    threshold: float
    verdict: str
    paper_verdict: str
    agrees: bool | None
    n: int  # items (resampling clusters) in the analysis
    component: str  # the binding component that estimate / CI / threshold belong to
    details: dict = field(default_factory=dict)
    figure_data: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("figure_data")
        return _jsonable(out)


@dataclass
class Tables:
    """The concatenated cell tables a claim needs (None for those it does not read)."""

    items: pd.DataFrame | None = None
    steps: pd.DataFrame | None = None


@dataclass(frozen=True)
class Options:
    n_boot: int
    seed: int
    alpha: float
    scale: str = "default"


@dataclass(frozen=True)
class ClaimDef:
    fn: Callable[[Tables, dict, dict, Options], ClaimResult]
    tables: tuple[str, ...]


REGISTRY: dict[str, ClaimDef] = {}


def register(claim_id: str, tables: tuple[str, ...] = ("items",)):
    """Decorator: make a claim function available under its pre-registered id."""
    def wrap(fn):
        REGISTRY[claim_id] = ClaimDef(fn, tables)
        return fn
    return wrap


def options_for(spec: dict, conventions: dict, scale: str = "default", n_boot: int | None = None,
                seed: int | None = None) -> Options:
    """Run options from the pre-registration, with explicit overrides (recorded in details)."""
    test = spec.get("test", {})
    return Options(
        n_boot=int(n_boot if n_boot is not None else test.get("n_boot", conventions.get("n_boot", 2000))),
        seed=int(seed if seed is not None else test.get("seed", 0)),
        alpha=1.0 - float(conventions.get("confidence_level", 0.95)),
        scale=scale,
    )


def run_claim(claim_id: str, tables: Tables, spec: dict, conventions: dict, opts: Options) -> ClaimResult:
    if claim_id not in REGISTRY:
        raise AnalysisError(f"claim={claim_id!r} is not one of {sorted(REGISTRY)}")
    result = REGISTRY[claim_id].fn(tables, spec, conventions, opts)
    prereg_boot = int(spec.get("test", {}).get("n_boot", conventions.get("n_boot", 2000)))
    result.details["run"] = {
        "scale": opts.scale, "n_boot": opts.n_boot, "seed": opts.seed, "alpha": opts.alpha,
        "n_boot_below_preregistered": opts.n_boot < prereg_boot,
    }
    return result


# --- shared helpers ----------------------------------------------------------------------------


def population(spec: dict, scale: str) -> dict:
    """The claim's population, with per-scale overrides (``population.scales.<scale>``) applied."""
    pop = {k: v for k, v in spec["population"].items() if k != "scales"}
    pop.update(spec["population"].get("scales", {}).get(scale, {}) or {})
    return pop


def _rule(spec: dict, name: str) -> dict:
    try:
        return spec["decision"]["components"][name]
    except KeyError:
        raise AnalysisError(f"claims.yaml: claim {spec.get('id')} has no decision component {name!r}") from None


def _signals(conv: dict) -> dict[str, str]:
    """Signal name -> column; '-' marks a column whose low values are suspect (confidence)."""
    return {"certificate": conv["certificate_signal"], "confidence": "-" + conv["confidence_signal"]}


def _finish(spec: dict, components: list[verdicts.Component], n: int, details: dict,
            figure_data: dict | None = None) -> ClaimResult:
    verdict = verdicts.combine(components)
    main = verdicts.binding(components)
    paper = spec["paper_verdict"]
    details = {"components": [c.as_dict() for c in components], **details}
    return ClaimResult(
        claim=spec["id"], title=spec["title"], estimate=main.estimate, ci_low=main.ci_low,
        ci_high=main.ci_high, threshold=main.threshold, verdict=verdict, paper_verdict=paper,
        agrees=verdicts.agrees(verdict, paper), n=int(n), component=main.name, details=details,
        figure_data=figure_data or {},
    )


_UNDEFINED = Interval(math.nan, math.nan, math.nan, 0, 0)


def _boot(stat, n_clusters: int, opts: Options, rows_per_cluster: float = 1.0) -> list[Interval]:
    return cluster_bootstrap(stat, n_clusters, n_boot=opts.n_boot, seed=opts.seed, alpha=opts.alpha,
                             rows_per_cluster=rows_per_cluster)


def _accuracy_table(items: pd.DataFrame, setting: str) -> list[dict]:
    """Accuracy (points) of every (policy, design, budget) in a setting: the budget figure's data."""
    rows = items[items["setting"] == setting]
    out = []
    for (p, d, b), g in rows.groupby(["policy", "design", "budget"], sort=True):
        per_item = data.per_unit_mean(g, "correct")
        out.append({"policy": p, "design": d, "budget": float(b), "accuracy": 100 * float(per_item.mean()),
                    "n_items": int(len(per_item))})
    return out


def _paired_matrix(columns: dict[str, pd.Series]) -> tuple[pd.DataFrame, int]:
    """Per-item values of several configurations on their common items (pairing)."""
    frame = pd.concat(columns, axis=1)
    complete = frame.dropna()
    return complete, int(len(frame) - len(complete))


def _runs(sel: pd.DataFrame, conv: dict) -> tuple[pd.DataFrame, list[str]]:
    """Runs with the primary signals, plus the secondary certificate when it is defined everywhere."""
    signals = _signals(conv)
    secondary = conv.get("secondary_certificate_signal")
    if secondary and secondary in sel and np.isfinite(sel[secondary].astype(float)).all():
        signals["certificate_max"] = secondary
    r = data.runs(sel, signals)
    if r.empty:
        raise AnalysisError("items.parquet: every selected run has a NaN certificate or confidence")
    return r, list(signals)


def _roc(scores, labels) -> dict:
    fpr, tpr = roc_curve(scores, labels)
    return {"fpr": fpr, "tpr": tpr}


# --- C1, C2: accuracy ----------------------------------------------------------------------------


FULL = ("full", "full", 1.0)  # key of the full-cache reference column


def _accuracy_claim(tables: Tables, spec: dict, opts: Options, arms, reference, rule_name: str) -> ClaimResult:
    """Shared body of C1/C2: paired accuracy differences (points), one component per arm.

    ``arms(pop)`` maps an arm name to its (policy, design, budget); ``reference(cfg)`` gives the
    configuration it is compared with (``FULL`` for the full cache). All arms and references are
    evaluated on the items that have every one of them (pairing).
    """
    pop = population(spec, opts.scale)
    items = tables.items
    sel = data.select(items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    arm_cfg = arms(pop)
    ref_cfg = {a: reference(cfg) for a, cfg in arm_cfg.items()}

    def per_item(cfg):
        if cfg == FULL:
            return data.reference(items, pop["setting"])
        p, d, b = cfg
        m = (sel["policy"] == p) & (sel["design"] == d) & data.budget_mask(sel, b)
        return data.per_unit_mean(sel[m], "correct")

    label = {cfg: ("full" if cfg == FULL else f"{cfg[0]},{cfg[1]},{cfg[2]:g}")
             for cfg in {*arm_cfg.values(), *ref_cfg.values()}}
    frame, dropped = _paired_matrix({label[cfg]: per_item(cfg) for cfg in label})
    if frame.empty:
        raise AnalysisError("items.parquet: no item has every configuration of the population and its reference")
    D = 100 * np.column_stack([frame[label[arm_cfg[a]]].to_numpy() - frame[label[ref_cfg[a]]].to_numpy()
                               for a in arm_cfg])
    ivs = _boot(lambda W: weighted_mean(D, W), len(frame), opts)
    rule = _rule(spec, rule_name)
    comps = [verdicts.decide(f"{rule_name}[{a}]", iv, rule) for a, iv in zip(arm_cfg, ivs)]
    details = {
        "accuracy": {c: 100 * float(frame[c].mean()) for c in frame.columns},
        "items_dropped_unpaired": dropped,
        "accuracy_by_configuration": _accuracy_table(items, pop["setting"]),
        **data.describe(sel),
    }
    return _finish(spec, comps, len(frame), details,
                   {"table": details["accuracy_by_configuration"], "setting": pop["setting"]})


@register("c1")
def claim_budget(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C1: each (policy, design, budget) loses at most the margin against the full cache."""
    def arms(pop):
        return {f"{p},{d},{b:g}": (p, d, float(b))
                for p in pop["policies"] for d in pop["designs"] for b in pop["budgets"]}
    return _accuracy_claim(tables, spec, opts, arms, lambda cfg: FULL, "accuracy_change")


@register("c2")
def claim_no_cost(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C2: Poisson+Hajek is non-inferior to top-k of the same score at each budget."""
    if not {"topk", "poisson"} <= set(spec["population"]["designs"]):
        raise AnalysisError("claims.yaml: c2 population.designs must include topk and poisson")

    def arms(pop):
        return {f"{p},{b:g}": (p, "poisson", float(b)) for p in pop["policies"] for b in pop["budgets"]}
    return _accuracy_claim(tables, spec, opts, arms, lambda cfg: (cfg[0], "topk", cfg[2]), "poisson_minus_topk")


# --- C3: coverage and rank correlation -----------------------------------------------------------


def _finite_steps(steps: pd.DataFrame, what: str) -> pd.DataFrame:
    ok = np.isfinite(steps["true_err"].astype(float)) & np.isfinite(steps["trace_var"].astype(float))
    if not ok.any():
        raise AnalysisError(f"steps.parquet: true_err is NaN in every row of {what} (run the cells with the oracle on)")
    return steps.loc[ok]


def _median_rel_err(steps: pd.DataFrame, setting: str, budget: float, configs: dict, opts: Options) -> dict:
    """Median relative error per design at one budget (reproduction numbers, not tested)."""
    out = {}
    base = steps[(steps["setting"] == setting) & data.budget_mask(steps, budget)]
    for name, cfg in configs.items():
        rows = base[(base["policy"] == cfg["policy"]) & (base["design"] == cfg["design"])]
        rows = rows[np.isfinite(rows["rel_err"].astype(float))]
        if rows.empty:
            out[name] = {"estimate": math.nan, "ci_low": math.nan, "ci_high": math.nan,
                         "note": f"no rows for policy={cfg['policy']} design={cfg['design']} budget={budget:g}"}
            continue
        cluster, n = data.cluster_index(rows)
        med = Median(rows["rel_err"].to_numpy(float))
        iv = _boot(lambda W: med(W[:, cluster]), n, opts, len(rows) / n)[0]
        out[name] = {**iv.as_dict(), "n_rows": int(len(rows)), "n_items": n}
    return out


@register("c3", tables=("steps",))
def claim_coverage(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C3: coverage of sqrt(trV/delta) >= threshold and Spearman(cert, true error) >= threshold."""
    pop = population(spec, opts.scale)
    delta = float(conv["delta"])
    sel = data.select(tables.steps, "steps", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    rows = _finite_steps(sel, "the c3 population")
    tv = rows["trace_var"].to_numpy(float)
    err = rows["true_err"].to_numpy(float)
    cert = np.sqrt(tv / delta)
    covered = (err <= cert).astype(float)
    cluster, n = data.cluster_index(rows)
    cov_i = np.bincount(cluster, weights=covered, minlength=n)
    cnt_i = np.bincount(cluster, minlength=n).astype(float)
    spear = Spearman(cert, err)

    def stat(W):
        return np.column_stack([(W @ cov_i) / (W @ cnt_i), spear(W[:, cluster])])

    cov_iv, sp_iv = _boot(stat, n, opts, len(rows) / n)
    comps = [verdicts.decide("coverage", cov_iv, _rule(spec, "coverage")),
             verdicts.decide("spearman", sp_iv, _rule(spec, "spearman"))]
    sec = spec.get("secondary", {})
    budgets = rows["budget"].to_numpy(float)
    grid = [float(x) for x in sec.get("delta_grid", [delta])]
    calibration = {
        f"{b:g}": [float(np.mean(err[np.isclose(budgets, b)] <= np.sqrt(tv[np.isclose(budgets, b)] / d)))
                   for d in grid]
        for b in pop["budgets"]
    }
    details = {
        "coverage": cov_iv.as_dict(),
        "spearman": sp_iv.as_dict(),
        "coverage_by_budget": {f"{b:g}": float(covered[np.isclose(budgets, b)].mean()) for b in pop["budgets"]},
        "coverage_normal_1.96": float(np.mean(err <= 1.96 * np.sqrt(tv))),
        "wald_coverage_mean": float(np.nanmean(rows["wald_coverage"].astype(float))),
        "runner_coverage_agreement": float(np.mean(rows["coverage"].astype(bool).to_numpy() == (covered > 0))),
        "calibration": {"delta": grid, "coverage": calibration},
        "n_rows": int(len(rows)),
        "n_rows_without_oracle": int(len(sel) - len(rows)),
        **data.describe(rows),
    }
    if "median_rel_err" in sec:
        details["median_rel_err"] = _median_rel_err(
            tables.steps, pop["setting"], float(sec.get("reproduction_budget", 0.25)), sec["median_rel_err"], opts)
    rng = np.random.default_rng(opts.seed)
    pick = rng.choice(len(rows), size=min(len(rows), 5000), replace=False)
    figure = {"calibration": details["calibration"], "cert": cert[pick], "true_err": err[pick],
              "budget": budgets[pick], "delta": delta}
    return _finish(spec, comps, n, details, figure)


# --- C4, C6: AUCs ---------------------------------------------------------------------------------


@register("c4")
def claim_prediction(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C4: AUC(certificate) - AUC(confidence) for predicting failure under eviction."""
    pop = population(spec, opts.scale)
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    r, names = _runs(sel, conv)
    fail = r["correct"].to_numpy(float) < 0.5
    cluster, n = data.cluster_index(r)
    scores = {s: r[s].to_numpy(float) for s in names}

    def stat(W):
        Wr = W[:, cluster]
        a = {s: auc(scores[s], fail, Wr) for s in names}
        return np.column_stack([a["certificate"] - a["confidence"]] + [a[s] for s in names])

    ivs = _boot(stat, n, opts, len(r) / n)
    comps = [verdicts.decide("auc_difference", ivs[0], _rule(spec, "auc_difference"))]
    details = {
        **{f"auc_{s}": iv.as_dict() for s, iv in zip(names, ivs[1:])},
        "n_runs": int(len(r)), "n_failures": int(fail.sum()), "n_successes": int((~fail).sum()),
        "n_runs_dropped_nan_signal": r.attrs.get("n_dropped_nan_signal", 0),
        **data.describe(sel),
    }
    figure = {"roc": {s: _roc(scores[s], fail) for s in names},
              "title": "failure prediction", "positive": "failure"}
    return _finish(spec, comps, n, details, figure)


@register("c6")
def claim_attribution(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C6: among failing runs, AUC of the certificate for cache-induced vs inherent failure."""
    pop = population(spec, opts.scale)
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    full = data.reference(tables.items, pop["setting"]).rename("full_correct").reset_index()
    r, names = _runs(sel, conv)
    r = r.merge(full, on=data.unit_columns(r), how="inner")
    failing = r[r["correct"] < 0.5].reset_index(drop=True)
    cache_induced = failing["full_correct"].to_numpy(float) >= 0.5
    cluster, n = data.cluster_index(failing)
    scores = {s: failing[s].to_numpy(float) for s in names}

    def stat(W):
        Wr = W[:, cluster]
        a = {s: auc(scores[s], cache_induced, Wr) for s in names}
        return np.column_stack([a["certificate"], a["certificate"] - a["confidence"]]
                               + [a[s] for s in names if s != "certificate"])

    # No failing run (possible with a handful of items): the AUCs are undefined -> inconclusive.
    ivs = _boot(stat, n, opts, len(failing) / n) if n else [_UNDEFINED] * (len(names) + 1)
    comps = [verdicts.decide("auc_certificate", ivs[0], _rule(spec, "auc_certificate")),
             verdicts.decide("auc_difference", ivs[1], _rule(spec, "auc_difference"))]
    details = {
        "auc_certificate": ivs[0].as_dict(),
        **{f"auc_{s}": iv.as_dict() for s, iv in zip([s for s in names if s != "certificate"], ivs[2:])},
        "n_failing_runs": int(len(failing)), "n_cache_induced": int(cache_induced.sum()),
        "n_inherent": int((~cache_induced).sum()),
        "n_runs_without_full_row": int(len(sel) - len(r) - r.attrs.get("n_dropped_nan_signal", 0)),
        **data.describe(sel),
    }
    figure = {"roc": {s: _roc(scores[s], cache_induced) for s in names},
              "title": "attribution among failures", "positive": "cache-induced"}
    return _finish(spec, comps, n, details, figure)


# --- C5, C7: replays ------------------------------------------------------------------------------


def _replay_intervals(rep: replay.Replay, q: float, opts: Options) -> dict[str, Interval]:
    signals = ["certificate", "confidence", replay.RANDOM]

    def stat(W):
        acc = {s: rep.accuracy(s, q, W) for s in signals}
        return np.column_stack([acc["certificate"] - acc[replay.RANDOM], acc["certificate"] - acc["confidence"],
                                *[acc[s] for s in signals], rep.accuracy(replay.RANDOM, 0.0, W),
                                rep.accuracy(replay.RANDOM, 1.0, W)])

    ivs = _boot(stat, rep.n_clusters, opts, len(rep.low) / rep.n_clusters)
    names = ["gain_over_random", "gain_over_confidence", "accuracy_certificate", "accuracy_confidence",
             "accuracy_random", "accuracy_without", "accuracy_all"]
    return dict(zip(names, ivs))


def _curves(rep: replay.Replay, grid) -> dict:
    return {"rate": [float(x) for x in grid],
            **{s: rep.curve(s, grid) for s in ("certificate", "confidence", replay.RANDOM)}}


@register("c5")
def claim_escalation(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C5: certificate-gated escalation low -> high budget vs random gating at the same rate."""
    pop = population(spec, opts.scale)
    low_b, high_b, q = float(pop["low_budget"]), float(pop["high_budget"]), float(pop["escalation_rate"])
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=[low_b, high_b])
    r, _ = _runs(sel[data.budget_mask(sel, low_b)], conv)
    rep = replay.escalation(r, sel[data.budget_mask(sel, high_b)], ["certificate", "confidence"])
    ivs = _replay_intervals(rep, q, opts)
    comps = [verdicts.decide("gain_over_random", ivs["gain_over_random"], _rule(spec, "gain_over_random"))]
    curves = _curves(rep, spec.get("secondary", {}).get("rate_grid", [0.0, q, 1.0]))
    details = {**{k: v.as_dict() for k, v in ivs.items()},
               "escalation_rate": q, "n_runs": int(len(rep.low)), "n_runs_unmatched": rep.n_unmatched_runs,
               "curve": curves, **data.describe(sel)}
    return _finish(spec, comps, rep.n_clusters, details,
                   {"curve": curves, "rate": q, "xlabel": "escalation rate", "title": "budget escalation"})


@register("c7")
def claim_recompute(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C7: certificate-ranked full-cache recompute vs random and vs confidence ranking."""
    pop = population(spec, opts.scale)
    q = float(pop["recompute_rate"])
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    r, _ = _runs(sel, conv)
    rep = replay.recompute(r, data.reference(tables.items, pop["setting"]), ["certificate", "confidence"])
    ivs = _replay_intervals(rep, q, opts)
    comps = [verdicts.decide(name, ivs[name], _rule(spec, name))
             for name in ("gain_over_random", "gain_over_confidence")]
    curves = _curves(rep, spec.get("secondary", {}).get("rate_grid", [0.0, q, 1.0]))
    details = {**{k: v.as_dict() for k, v in ivs.items()},
               "recompute_rate": q, "n_runs": int(len(rep.low)), "n_runs_unmatched": rep.n_unmatched_runs,
               "curve": curves, **data.describe(sel)}
    return _finish(spec, comps, rep.n_clusters, details,
                   {"curve": curves, "rate": q, "xlabel": "recompute budget (fraction of runs)",
                    "title": "recompute scheduling"})


# --- serialization -------------------------------------------------------------------------------


def _jsonable(x):
    """Plain JSON types; NaN becomes None so the file is strict JSON."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return [_jsonable(v) for v in x.tolist()]
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return None if not math.isfinite(float(x)) else float(x)
    return x

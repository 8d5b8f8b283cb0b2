"""Claim variants that decide a claim within strata: per model (C6, C7) and per configuration (C2, C3).

Amendment 5 (preregistration/amendment-5/amendment.yaml) selects these by name:

    analysis:
      c2_scope: per_configuration   # C2 per (scorer, allocator, certain-head share) and budget
      c3_scope: per_configuration   # C3 per (scorer, allocator, certain-head share), budgets pooled
      c6_ranking: within_model      # C6's AUCs over (cache-induced, inherent) pairs of the same model
      c7_gating: within_model       # C7's gate fires for the top recompute_rate of each model's runs

Why per model: certificates are on different scales for different models, so a pooled ranking compares one
model's runs with the other's (amendment 4's finding for C5; v4-full's C6 and C7 show the same). Why per
configuration: the thesis is that *any* ranking can be randomized at no accuracy cost with a valid certificate,
so each ranking (scorer), each budget allocator and each certain-head share is a component of its own.

A configuration is the triple (policy, allocator, head_fraction) of an items/steps row: a table without an
``allocator`` column holds uniform cells only, one without ``head_fraction`` the design default's share
(kvcert.run_schema: 0.5). Top-k keeps no sampled tail, so its accuracy does not depend on the share: the top-k
reference of Poisson at share h is top-k of the same policy, allocator and budget at any share (their per-item
mean when several cells hold it). The policies are claims.yaml's (SnapKV) and every other policy of the claim's setting
with rows of both designs (C2) or Poisson step rows (C3) at every budget of the population (``policies_of``;
the others are named in ``details.policies_left_out``): that is the amendment's stated change.

Verdicts: the claim's verdict is claims.yaml's rule over all its components (kvcert.analysis.verdicts.combine);
``details.verdict_by`` applies the same rule to the components of each policy, each allocator and each share
(e.g. "C2 holds for TOVA" = every TOVA component supported). Populations, bootstrap (items resampled jointly
across components), decision thresholds and margins are version 1's; the building blocks are
kvcert.analysis.parts, and C5's within-group replay is the frozen kvcert.analysis.variants'.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvcert.analysis import data, discrimination, parts, replay, verdicts
from kvcert.analysis.claims import ClaimResult, Options, Tables, population
from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.stats import Median, Spearman, weighted_mean
from kvcert.analysis.variants import WithinGroupReplay

# (choice, claim, name, tables, function) of this module's variants: kvcert.analysis.registry registers them. The
# registry imports this module, so this module does not import the registry back (no import circle).
VARIANTS: list[tuple[str, str, str, tuple[str, ...], object]] = []


def variant(choice: str, claim: str, name: str, tables: tuple[str, ...] = ("items",), *,
            reads_configurations: bool = False):
    """Decorator: list ``fn(tables, spec, conventions, opts) -> ClaimResult`` as variant ``name`` of ``choice``
    (replacing claim ``claim``) in VARIANTS. ``reads_configurations``: the variant tells configurations apart
    itself and reads every row; any other claim reads ``default_configuration``'s rows only."""
    def add(fn):
        fn.reads_configurations = reads_configurations
        VARIANTS.append((choice, claim, name, tables, fn))
        return fn
    return add

MODEL = "model"
ALLOCATOR, SHARE = "allocator", "head_fraction"
DEFAULT_ALLOCATOR = "uniform"
# The design's default certain-head share (kvcert.run_schema.DESIGN.head_fraction; the analysis layer does not
# import the run schema, and tests/test_strata.py checks the two agree).
DEFAULT_SHARE = 0.5
# C6's AUC method: version 4's base analysis (amendment2) computes its AUCs by scikit-learn's method.
AUC_METHOD = "sklearn"


def with_configuration(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``allocator`` and ``head_fraction`` columns filled in where the table lacks them (see module)."""
    out = df.copy()
    if ALLOCATOR not in out.columns:
        out[ALLOCATOR] = DEFAULT_ALLOCATOR
    out[ALLOCATOR] = out[ALLOCATOR].fillna(DEFAULT_ALLOCATOR).astype(str)
    if SHARE not in out.columns:
        out[SHARE] = DEFAULT_SHARE
    out[SHARE] = out[SHARE].astype(float).fillna(DEFAULT_SHARE)
    return out


def reads_configurations(fn) -> bool:
    """Whether a claim function decides per configuration (reads every row) rather than on the default's rows."""
    return bool(getattr(fn, "reads_configurations", False))


def default_configuration(tables: Tables) -> Tables:
    """``tables`` restricted to versions 1-4's one configuration, the uniform allocator at the default certain-head
    share: the rows every claim that is not decided per configuration reads (under amendment 5: C1, C4, C5, C6
    and C7), so that a study's other configurations do not enter claims.yaml's populations. A table without the
    ``allocator`` / ``head_fraction`` columns holds that configuration only and is returned as it is (every table
    of versions 1-4)."""
    return Tables(items=_default_rows(tables.items), steps=_default_rows(tables.steps))


def _default_rows(df: pd.DataFrame | None) -> pd.DataFrame | None:
    if df is None:
        return None
    keep = np.ones(len(df), dtype=bool)
    if ALLOCATOR in df.columns:
        keep &= df[ALLOCATOR].fillna(DEFAULT_ALLOCATOR).astype(str).eq(DEFAULT_ALLOCATOR).to_numpy()
    if SHARE in df.columns:
        keep &= np.isclose(df[SHARE].astype(float).fillna(DEFAULT_SHARE).to_numpy(), DEFAULT_SHARE)
    return df if keep.all() else df[keep]


def verdict_by(components: list[verdicts.Component], keys: dict[str, tuple]) -> dict[str, dict[str, str]]:
    """claims.yaml's verdict rule applied to the components of each value of each factor.

    keys: component name -> {factor: value} (e.g. {"policy": "tova", "allocator": "uniform", ...}); returns
    {factor: {value: verdict}}."""
    out: dict[str, dict[str, list]] = {}
    for comp in components:
        for factor, value in keys[comp.name].items():
            out.setdefault(factor, {}).setdefault(str(value), []).append(comp)
    return {f: {v: verdicts.combine(cs) for v, cs in sorted(values.items())} for f, values in out.items()}


def policies_of(df: pd.DataFrame, pop: dict, designs: list[str]) -> tuple[list[str], list[str]]:
    """(policies, left out): claims.yaml's policies of the claim (required) and every other policy of the claim's
    setting that has rows of each of ``designs`` at each of the population's budgets; the setting's other policies
    (the full cache, a uniform-sampling baseline run at one budget only, ...) are left out and named."""
    rows = df[df["setting"] == pop["setting"]]
    complete, left_out = [], []
    for p in sorted(set(map(str, rows["policy"].unique())) - {"full"}):
        have = rows[rows["policy"] == p]
        ok = all(((have["design"] == d) & data.budget_mask(have, b)).any() for d in designs for b in pop["budgets"])
        (complete if ok else left_out).append(p)
    return sorted(set(pop["policies"]) | set(complete)), left_out


# --- C2 per configuration ----------------------------------------------------------------------------------


@variant("c2_scope", "c2", "per_configuration", reads_configurations=True)
def no_cost_per_configuration(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C2 with one component per (policy, allocator, share, budget): Poisson+Hajek minus top-k of the same
    policy, allocator and budget, paired per item (points), items bootstrapped jointly over every component."""
    pop = population(spec, opts.scale)
    policies, left_out = policies_of(tables.items, pop, ["topk", "poisson"])
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=policies, designs=["topk", "poisson"],
                      budgets=pop["budgets"])
    sel = with_configuration(sel)
    topk_policies = set(sel.loc[sel["design"] == "topk", "policy"])
    poisson = sel[(sel["design"] == "poisson") & sel["policy"].isin(topk_policies)]
    arms = sorted({(p, a, float(h), float(b)) for p, a, h, b in
                   poisson[["policy", ALLOCATOR, SHARE, "budget"]].itertuples(index=False)})
    if not arms:
        raise AnalysisError("items.parquet: no policy has both topk and poisson rows in the c2 population")
    columns, names, keys = {}, [], {}
    for p, a, h, b in arms:
        same = (sel["policy"] == p) & (sel[ALLOCATOR] == a) & data.budget_mask(sel, b)
        columns[("poisson", p, a, h, b)] = data.per_unit_mean(
            sel[same & (sel["design"] == "poisson") & np.isclose(sel[SHARE], h)], "correct")
        columns[("topk", p, a, b)] = data.per_unit_mean(sel[same & (sel["design"] == "topk")], "correct")
        name = f"poisson_minus_topk[{p},{a},{h:g},{b:g}]"
        names.append(name)
        keys[name] = {"policy": p, "allocator": a, SHARE: f"{h:g}", "budget": f"{b:g}"}
    frame = pd.concat({str(k): v for k, v in columns.items()}, axis=1)
    complete = frame.dropna()
    if complete.empty:
        raise AnalysisError("items.parquet: no item has every configuration of the c2 population")
    D = 100 * np.column_stack([complete[str(("poisson", p, a, h, b))].to_numpy()
                               - complete[str(("topk", p, a, b))].to_numpy() for p, a, h, b in arms])
    ivs = parts.bootstrap(lambda W: weighted_mean(D, W), len(complete), opts)
    rule = parts.rule(spec, "poisson_minus_topk")
    comps = [verdicts.decide(name, iv, rule) for name, iv in zip(names, ivs)]
    details = {
        "scope": "per_configuration", "configurations": keys, "policies_left_out": left_out,
        "verdict_by": verdict_by(comps, keys),
        "items_dropped_unpaired": int(len(frame) - len(complete)),
        **data.describe(sel),
    }
    return parts.finish(spec, comps, len(complete), details)


# --- C3 per configuration ----------------------------------------------------------------------------------


@variant("c3_scope", "c3", "per_configuration", tables=("steps",), reads_configurations=True)
def coverage_per_configuration(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C3 with components coverage[p,a,h] and spearman[p,a,h] per (policy, allocator, share), budgets pooled,
    plus the descriptive median of certificate / true error over a configuration's step rows (its width
    relative to the error it bounds: the price of a larger certain share)."""
    pop = population(spec, opts.scale)
    delta = float(conv["delta"])
    policies, left_out = policies_of(tables.steps, pop, ["poisson"])
    sel = data.select(tables.steps, "steps", setting=pop["setting"], policies=policies, designs=["poisson"],
                      budgets=pop["budgets"])
    ok = np.isfinite(sel["true_err"].astype(float)) & np.isfinite(sel["trace_var"].astype(float))
    rows = with_configuration(sel.loc[ok]).reset_index(drop=True)
    if rows.empty:
        raise AnalysisError("steps.parquet: true_err is NaN in every row of the c3 population (run the oracle cells)")
    cert = np.sqrt(rows["trace_var"].to_numpy(float) / delta)
    err = rows["true_err"].to_numpy(float)
    covered = (err <= cert).astype(float)
    cluster, n = data.cluster_index(rows)
    configs = sorted({(p, a, float(h)) for p, a, h in rows[["policy", ALLOCATOR, SHARE]].itertuples(index=False)})
    parts_of = []
    for p, a, h in configs:
        m = ((rows["policy"] == p) & (rows[ALLOCATOR] == a) & np.isclose(rows[SHARE], h)).to_numpy()
        parts_of.append((m, np.bincount(cluster[m], weights=covered[m], minlength=n),
                         np.bincount(cluster[m], minlength=n).astype(float), Spearman(cert[m], err[m])))

    def stat(W):
        cols = []
        for m, cov_i, cnt_i, spear in parts_of:
            cols += [(W @ cov_i) / (W @ cnt_i), spear(W[:, cluster[m]])]
        return np.column_stack(cols)

    ivs = parts.bootstrap(stat, n, opts, len(rows) / n)
    comps, keys, ratio = [], {}, {}
    for i, (p, a, h) in enumerate(configs):
        label = f"{p},{a},{h:g}"
        for j, component in enumerate(("coverage", "spearman")):
            name = f"{component}[{label}]"
            comps.append(verdicts.decide(name, ivs[2 * i + j], parts.rule(spec, component)))
            keys[name] = {"policy": p, "allocator": a, SHARE: f"{h:g}"}
        m = parts_of[i][0] & (err > 0)
        ratio[label] = float(np.median(cert[m] / err[m])) if m.any() else float("nan")
    details = {
        "scope": "per_configuration", "configurations": keys, "policies_left_out": left_out,
        "verdict_by": verdict_by(comps, keys), "cert_over_true_err_median": ratio, "n_rows": int(len(rows)), **data.describe(rows),
    }
    return parts.finish(spec, comps, n, details)


# --- C6, C7 within each model ------------------------------------------------------------------------------


def within_model_auc(method: discrimination.AucMethod, scores: np.ndarray, labels: np.ndarray,
                     group: np.ndarray, W: np.ndarray) -> np.ndarray:
    """The AUC over (positive, negative) pairs of the same group: each group's AUC weighted by its number of
    pairs under the bootstrap weights. scores, labels, group: (n,); W: (B, n) run weights -> (B,) AUCs (NaN
    where no group has both classes)."""
    num = np.zeros(W.shape[0])
    den = np.zeros(W.shape[0])
    for g in np.unique(group):
        m = group == g
        pos, neg = labels[m], ~labels[m]
        if not pos.any() or not neg.any():
            continue
        pairs = W[:, m][:, pos].sum(axis=1) * W[:, m][:, neg].sum(axis=1)
        a = method.auc(scores[m], labels[m], W[:, m])
        keep = pairs > 0
        num[keep] += (a * pairs)[keep]
        den += pairs
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


@variant("c6_ranking", "c6", "within_model")
def attribution_within_model(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C6 with its AUCs over (cache-induced, inherent) failing-run pairs of the same model: population, runs,
    classes, bootstrap, components and decision rule are version 4's (amendment 2's scikit-learn AUC)."""
    method = discrimination.AUC_METHODS[AUC_METHOD]()
    pop = population(spec, opts.scale)
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    if MODEL not in sel.columns:
        raise AnalysisError(f"items.parquet: no {MODEL!r} column, so C6 cannot rank within each model")
    full = data.reference(tables.items, pop["setting"]).rename("full_correct").reset_index()
    r, names = parts.runs(sel, conv)
    r = r.merge(full, on=data.unit_columns(r), how="inner")
    failing = r[r["correct"] < 0.5].reset_index(drop=True)
    cache_induced = failing["full_correct"].to_numpy(float) >= 0.5
    models = sorted(map(str, failing[MODEL].unique())) if len(failing) else []
    group = failing[MODEL].astype(str).map({m: i for i, m in enumerate(models)}).to_numpy(int)
    cluster, n = data.cluster_index(failing)
    scores = {s: failing[s].to_numpy(float) for s in names}
    others = [s for s in names if s != "certificate"]

    def stat(W):
        a = {s: within_model_auc(method, scores[s], cache_induced, group, W[:, cluster]) for s in names}
        return np.column_stack([a["certificate"], a["certificate"] - a["confidence"]] + [a[s] for s in others])

    ivs = parts.bootstrap(stat, n, opts, len(failing) / n) if n else [parts.UNDEFINED] * (len(names) + 1)
    comps = [verdicts.decide("auc_certificate", ivs[0], parts.rule(spec, "auc_certificate")),
             verdicts.decide("auc_difference", ivs[1], parts.rule(spec, "auc_difference"))]
    by_model = {m: {"n_inherent": int((~cache_induced[group == i]).sum()),
                    "n_cache_induced": int(cache_induced[group == i].sum())} for i, m in enumerate(models)}
    # the figure: each model's ROC curves, since the AUC is computed within each model
    roc = {f"{s}, {m}": method.roc(scores[s][group == i], cache_induced[group == i])
           for i, m in enumerate(models) for s in ("certificate", "confidence")
           if cache_induced[group == i].any() and (~cache_induced[group == i]).any()}
    details = {
        "ranking": "within_model", "auc_certificate": ivs[0].as_dict(),
        **{f"auc_{s}": iv.as_dict() for s, iv in zip(others, ivs[2:])},
        "n_failing_runs": int(len(failing)), "n_cache_induced": int(cache_induced.sum()),
        "n_inherent": int((~cache_induced).sum()), "classes_by_model": by_model, **data.describe(sel),
    }
    return parts.finish(spec, comps, n, details, {"roc": roc, "positive": "cache-induced failure",
                                                  "title": "failure attribution, within each model"})


@variant("c7_gating", "c7", "within_model")
def recompute_within_model(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C7 with the gate firing for the top recompute_rate of each model's runs (as amendment 4's C5 gate);
    random gating, runs, recomputed outcome, bootstrap, components and decision rule are version 1's."""
    pop = population(spec, opts.scale)
    q = float(pop["recompute_rate"])
    sel = data.select(tables.items, "items", setting=pop["setting"], policies=pop["policies"],
                      designs=pop["designs"], budgets=pop["budgets"])
    if MODEL not in sel.columns:
        raise AnalysisError(f"items.parquet: no {MODEL!r} column, so C7's gate cannot rank within each model")
    r, _ = parts.runs(sel, conv)
    models = sorted(map(str, r[MODEL].unique()))
    # The model rides through the replay's merge as one more per-run signal, so it stays aligned with its run.
    r["_model_code"] = r[MODEL].astype(str).map({m: i for i, m in enumerate(models)}).astype(float)
    base = replay.recompute(r, data.reference(tables.items, pop["setting"]), ["certificate", "confidence", "_model_code"])
    group = base.signals.pop("_model_code").astype(int)
    base.signals.pop(replay.RANDOM)  # re-added by the subclass's __post_init__
    rep = WithinGroupReplay(low=base.low, better=base.better, signals=base.signals, cluster=base.cluster,
                            n_clusters=base.n_clusters, n_unmatched_runs=base.n_unmatched_runs, group=group)
    ivs = parts.replay_intervals(rep, q, opts)
    comps = [verdicts.decide(name, ivs[name], parts.rule(spec, name))
             for name in ("gain_over_random", "gain_over_confidence")]
    curves = parts.curves(rep, spec.get("secondary", {}).get("rate_grid", [0.0, q, 1.0]))
    details = {**{k: v.as_dict() for k, v in ivs.items()}, "recompute_rate": q, "gating": "within_model",
               "gated_models": models, "n_runs": int(len(rep.low)), "n_runs_unmatched": rep.n_unmatched_runs,
               "n_runs_by_model": {m: int((group == i).sum()) for i, m in enumerate(models)},
               "curve": curves, **data.describe(sel)}
    return parts.finish(spec, comps, rep.n_clusters, details,
                        {"curve": curves, "rate": q, "xlabel": "recompute budget (fraction of each model's runs)",
                         "title": "recompute scheduling, within each model"})

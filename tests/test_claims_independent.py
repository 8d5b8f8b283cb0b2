"""Every claim's point estimate recomputed independently of ``kvcert.analysis`` (pandas, numpy, scipy and
scikit-learn only), from the text of ``preregistration/claims.yaml``, on a small fixed cell table.

The table is built here with pandas (seeded) and written as the two parquet files a cell holds; the
analysis reads them with ``kvcert.analysis.data.load_cells`` (its loader) and runs each claim with
``claims.run_claim``. The table has what real cells have and what pairing must handle: several Poisson seeds
per item, an item without its full-cache row, an item without one configuration, runs whose certificate is
NaN (an answer that stopped at the first token), step rows without the oracle, and a low-budget run without
a high-budget counterpart. Each recomputation follows the pre-registered wording:

* C1/C2: per item, the mean correctness over seeds; items that have every configuration of the population
  and its reference (paired); the mean over those items of the difference, in points;
* C3: coverage = share of step rows with true_err ≤ √(trace_var / δ); Spearman of √(trace_var / δ) with
  true_err (scipy, mid-ranks);
* C4/C6: ROC AUC (scikit-learn) of the certificate and of the negated confidence, over runs (C4: failure;
  C6: cache-induced among failing runs);
* C5/C7: replayed accuracy with the top 25% of runs by a signal intervened on, minus the exact expectation of
  a random 25%, in points. The signals have no ties, so "the top 25%" is unambiguous (the run at the
  boundary counts with the fraction of the quota left).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from kvcert.analysis import claims, data

ROOT = Path(__file__).resolve().parents[1]
UNITS = ["model", "data", "task", "item_id"]
N_ITEMS = 24
SEEDS = (0, 1, 2)
TOL = 1e-9


# --------------------------------------------------------------------------- the fixed cell table


def _tables(seed: int = 7) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    items, steps = [], []
    configs = {
        "question_aware": [("full", "full", 1.0, [0])]
        + [("snapkv", d, b, list(SEEDS) if d == "poisson" else [0]) for d in ("topk", "poisson") for b in (0.25, 0.5)]
        + [("uniform", "poisson", 0.25, list(SEEDS))],
        "streaming": [("full", "full", 1.0, [0]), ("snapkv", "poisson", 0.25, list(SEEDS)),
                      ("snapkv", "topk", 0.25, [0])],
    }
    for k in range(N_ITEMS):
        unit = {"model": "tiny", "data": "fixture", "task": "ta" if k % 2 else "tb", "item_id": f"i{k:02d}"}
        ease = rng.uniform(0.2, 0.95)
        for setting, grid in configs.items():
            for policy, design, budget, seeds in grid:
                for s in seeds:
                    p = ease if policy == "full" else ease * (0.5 + budget) * (0.7 if setting == "streaming" else 1)
                    correct = bool(rng.random() < p)
                    randomized = design == "poisson"
                    cert = rng.gamma(2.0, 0.05) + (0.0 if correct else 0.04) if randomized else np.nan
                    items.append({**unit, "policy": policy, "design": design, "budget": budget, "seed": s,
                                  "setting": setting, "correct": correct,
                                  "logprob_mean": -rng.gamma(1.5, 0.4) - (0.0 if correct else 0.3),
                                  "cert_mean": cert, "cert_max": cert * rng.uniform(1.5, 3.0) if randomized else np.nan})
                    if policy == "full" or setting != "question_aware":
                        continue
                    for step in range(3):
                        for layer in range(2):
                            for head in range(2):
                                tv = rng.gamma(2.0, 1e-4) if randomized else 0.0
                                err = abs(rng.normal(0, np.sqrt(tv) * rng.uniform(0.5, 2.5))) if randomized \
                                    else rng.gamma(2.0, 0.01)
                                steps.append({**unit, "policy": policy, "design": design, "budget": budget,
                                              "seed": s, "setting": setting, "step": step, "layer": layer,
                                              "kv_head": head, "trace_var": tv, "true_err": err,
                                              "rel_err": err / 2.0, "coverage": float(err <= np.sqrt(tv / 0.05)),
                                              "wald_coverage": 0.9})
    items, steps = pd.DataFrame(items), pd.DataFrame(steps)

    def drop(frame, **match):
        mask = np.ones(len(frame), dtype=bool)
        for key, value in match.items():
            mask &= frame[key].to_numpy() == value
        assert mask.any(), match
        return frame[~mask].reset_index(drop=True)

    items = drop(items, item_id="i05", policy="full", setting="question_aware")  # no full-cache reference
    items = drop(items, item_id="i03", design="topk", budget=0.5, setting="question_aware")  # one arm missing
    items = drop(items, item_id="i08", design="poisson", budget=0.25, seed=1, setting="question_aware")
    items = drop(items, item_id="i09", policy="snapkv", budget=0.5, setting="question_aware", design="poisson")
    items = drop(items, item_id="i11", policy="full", setting="streaming")
    stopped = (items["item_id"].isin(["i02", "i13"]) & (items["policy"] == "snapkv") & (items["design"] == "poisson")
               & (items["budget"] == 0.25) & (items["seed"] == 0))
    items.loc[stopped, ["cert_mean", "cert_max"]] = np.nan  # stopped at the first token: no certificate
    steps.loc[steps["item_id"] == "i07", "true_err"] = np.nan  # this item ran without the oracle
    return items, steps


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    """The fixed table written as one cell, read back with the analysis's loader."""
    items, steps = _tables()
    path = tmp_path_factory.mktemp("cell")
    items.to_parquet(path / "items.parquet", index=False)
    steps.to_parquet(path / "steps.parquet", index=False)
    return data.load_cells([path], "items"), data.load_cells([path], "steps")


@pytest.fixture(scope="module")
def prereg():
    doc = yaml.safe_load((ROOT / "preregistration" / "claims.yaml").read_text())
    return doc["conventions"], {c["id"]: c for c in doc["claims"]}


def analysed(claim_id, cell, prereg):
    conv, specs = prereg
    items, steps = cell
    opts = claims.options_for(specs[claim_id], conv, n_boot=40)
    res = claims.run_claim(claim_id, claims.Tables(items, steps), specs[claim_id], conv, opts)
    comps = {c["name"]: c["estimate"] for c in res.details["components"]}
    assert res.estimate == comps[res.component]  # the reported estimate is that of the binding component
    return res, comps


# --------------------------------------------------------------------------- independent recomputation


def _config_rows(items, setting, policy, design, budget):
    return items[(items["setting"] == setting) & (items["policy"] == policy) & (items["design"] == design)
                 & np.isclose(items["budget"], budget)]


def _per_item(rows) -> pd.Series:
    return rows.assign(correct=rows["correct"].astype(float)).groupby(UNITS)["correct"].mean()


def _full(items, setting) -> pd.Series:
    return _per_item(items[(items["policy"] == "full") & (items["setting"] == setting)])


def _pop(spec):
    return spec["population"]


def test_c1_paired_differences_from_the_full_cache(cell, prereg):
    res, comps = analysed("c1", cell, prereg)
    items = cell[0]
    pop = _pop(prereg[1]["c1"])
    columns = {(p, d, b): _per_item(_config_rows(items, pop["setting"], p, d, b))
               for p in pop["policies"] for d in pop["designs"] for b in pop["budgets"]}
    full = _full(items, pop["setting"])
    paired = pd.DataFrame({**{k: v for k, v in columns.items()}, "full": full}).dropna()
    assert len(paired) == res.n < N_ITEMS  # items i03, i05, i09 are not paired
    for (p, d, b), col in columns.items():
        expected = 100 * (paired[(p, d, b)] - paired["full"]).mean()
        assert comps[f"accuracy_change[{p},{d},{b:g}]"] == pytest.approx(expected, abs=TOL)
    # An unpaired difference (each arm over its own items) is another number on this table.
    unpaired = [100 * (col.mean() - full.mean()) for col in columns.values()]
    paired_values = [100 * (paired[k] - paired["full"]).mean() for k in columns]
    assert max(abs(u - v) for u, v in zip(unpaired, paired_values)) > 0.5


def test_c2_paired_poisson_minus_topk(cell, prereg):
    res, comps = analysed("c2", cell, prereg)
    items = cell[0]
    pop = _pop(prereg[1]["c2"])
    columns = {(d, b): _per_item(_config_rows(items, pop["setting"], "snapkv", d, b))
               for d in ("poisson", "topk") for b in pop["budgets"]}
    paired = pd.DataFrame(columns).dropna()
    assert len(paired) == res.n
    for b in pop["budgets"]:
        expected = 100 * (paired[("poisson", b)] - paired[("topk", b)]).mean()
        assert comps[f"poisson_minus_topk[snapkv,{b:g}]"] == pytest.approx(expected, abs=TOL)


def test_c3_coverage_and_spearman(cell, prereg):
    res, comps = analysed("c3", cell, prereg)
    conv, specs = prereg
    steps = cell[1]
    pop = _pop(specs["c3"])
    rows = steps[(steps["setting"] == pop["setting"]) & steps["policy"].isin(pop["policies"])
                 & steps["design"].isin(pop["designs"]) & steps["budget"].isin(pop["budgets"])]
    rows = rows[np.isfinite(rows["true_err"]) & np.isfinite(rows["trace_var"])]
    cert = np.sqrt(rows["trace_var"] / conv["delta"])
    assert comps["coverage"] == pytest.approx(float((rows["true_err"] <= cert).mean()), abs=TOL)
    assert comps["spearman"] == pytest.approx(spearmanr(cert, rows["true_err"]).statistic, abs=TOL)
    assert res.n == rows.groupby(UNITS).ngroups == N_ITEMS - 1  # i07 has no oracle rows


def _runs(items, setting, budget, conv) -> pd.DataFrame:
    """Runs of SnapKV Poisson at ``budget``, with finite certificate and confidence."""
    rows = _config_rows(items, setting, "snapkv", "poisson", budget)
    rows = rows[np.isfinite(rows[conv["certificate_signal"]]) & np.isfinite(rows[conv["confidence_signal"]])]
    return rows.assign(correct=rows["correct"].astype(float),
                       certificate=rows[conv["certificate_signal"]],
                       confidence=-rows[conv["confidence_signal"]])  # low log-probability is suspect


def test_c4_auc_difference_for_failure(cell, prereg):
    res, comps = analysed("c4", cell, prereg)
    conv, specs = prereg
    runs = _runs(cell[0], _pop(specs["c4"])["setting"], 0.25, conv)
    fail = runs["correct"] < 0.5
    expected = roc_auc_score(fail, runs["certificate"]) - roc_auc_score(fail, runs["confidence"])
    assert comps["auc_difference"] == pytest.approx(expected, abs=TOL)
    assert res.details["auc_certificate"]["estimate"] == pytest.approx(roc_auc_score(fail, runs["certificate"]), abs=TOL)
    assert res.details["n_runs"] == len(runs)


def test_c6_attribution_auc_among_failures(cell, prereg):
    res, comps = analysed("c6", cell, prereg)
    conv, specs = prereg
    setting = _pop(specs["c6"])["setting"]
    runs = _runs(cell[0], setting, 0.25, conv).merge(_full(cell[0], setting).rename("full_correct").reset_index(),
                                                     on=UNITS, how="inner")
    failing = runs[runs["correct"] < 0.5]
    induced = failing["full_correct"] >= 0.5
    auc_cert = roc_auc_score(induced, failing["certificate"])
    assert comps["auc_certificate"] == pytest.approx(auc_cert, abs=TOL)
    assert comps["auc_difference"] == pytest.approx(auc_cert - roc_auc_score(induced, failing["confidence"]), abs=TOL)
    assert res.details["n_failing_runs"] == len(failing)


def _gated_accuracy(low: np.ndarray, better: np.ndarray, signal: np.ndarray, q: float) -> float:
    """Accuracy (points) when the top fraction q of runs by ``signal`` takes ``better`` instead of ``low``."""
    assert len(np.unique(signal)) == len(signal), "the fixture's signals have no ties"
    quota = q * len(low)
    fired = np.zeros(len(low))
    for rank, i in enumerate(np.argsort(-signal)):
        fired[i] = min(1.0, max(0.0, quota - rank))
    return 100 * float(np.mean(low + fired * (better - low)))


def _random_accuracy(low, better, q):
    return 100 * float(np.mean(low) + q * np.mean(better - low))


def test_c5_escalation_gain_over_random(cell, prereg):
    res, comps = analysed("c5", cell, prereg)
    conv, specs = prereg
    pop = _pop(specs["c5"])
    low = _runs(cell[0], pop["setting"], pop["low_budget"], conv)
    high = _per_item(_config_rows(cell[0], pop["setting"], "snapkv", "poisson", pop["high_budget"]))
    merged = low.merge(high.rename("better").reset_index(), on=UNITS, how="inner")
    assert len(merged) < len(low)  # i09 has no high-budget runs
    q = pop["escalation_rate"]
    a, b = merged["correct"].to_numpy(), merged["better"].to_numpy()
    expected = _gated_accuracy(a, b, merged["certificate"].to_numpy(), q) - _random_accuracy(a, b, q)
    assert comps["gain_over_random"] == pytest.approx(expected, abs=TOL)


def test_c7_recompute_gains(cell, prereg):
    res, comps = analysed("c7", cell, prereg)
    conv, specs = prereg
    pop = _pop(specs["c7"])
    runs = _runs(cell[0], pop["setting"], 0.25, conv)
    merged = runs.merge(_full(cell[0], pop["setting"]).rename("better").reset_index(), on=UNITS, how="inner")
    q = pop["recompute_rate"]
    a, b = merged["correct"].to_numpy(), merged["better"].to_numpy()
    by_cert = _gated_accuracy(a, b, merged["certificate"].to_numpy(), q)
    assert comps["gain_over_random"] == pytest.approx(by_cert - _random_accuracy(a, b, q), abs=TOL)
    assert comps["gain_over_confidence"] == pytest.approx(
        by_cert - _gated_accuracy(a, b, merged["confidence"].to_numpy(), q), abs=TOL)

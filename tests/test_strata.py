"""Amendment 5's claim variants (kvcert.analysis.strata): C2 and C3 per (scorer, allocator, certain-head share),
C6 and C7 ranked within each model.

Synthetic tables whose expected numbers are derived here by hand, not by the analysis code. Every number here
is test data, never a result.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvcert.analysis import prereg, registry, strata
from kvcert.analysis.claims import Tables, options_for

ROOT = Path(__file__).resolve().parents[1]
N_ITEMS = 20


@pytest.fixture(scope="module")
def claims_doc() -> dict:
    return prereg.load_claims(ROOT)


def _run(claim: str, fn, tables: Tables, doc: dict, n_boot: int = 200):
    spec = prereg.claim_spec(doc, claim)
    return fn(tables, spec, doc["conventions"], options_for(spec, doc["conventions"], n_boot=n_boot, seed=1))


def _row(item: int, model: str = "a", **kw) -> dict:
    return {"item_id": f"{model}/{item}", "model": model, "data": "synthetic", "task": "t", "seed": 0,
            "setting": "question_aware", "logprob_mean": -0.5, "cert_mean": 1.0, "cert_max": 2.0, **kw}


def test_default_share_is_the_design_default():
    from kvcert.run_schema import DESIGN

    assert strata.DEFAULT_SHARE == DESIGN.head_fraction


def test_c2_has_one_component_per_scorer_allocator_share_and_budget(claims_doc):
    # snapkv: top-k always right; Poisson at share 0.5 right on half the items (-50 points), at 0.95 always right.
    # tova (uniform, share 0.5 only): Poisson equals top-k (0 points). adakv over snapkv: no allocator column
    # value means uniform, so those rows carry allocator=adakv explicitly.
    rows = []
    for i in range(N_ITEMS):
        for b in (0.25, 0.5):
            rows.append(_row(i, policy="snapkv", design="topk", budget=b, correct=True))
            rows.append(_row(i, policy="snapkv", design="poisson", budget=b, head_fraction=0.5, correct=i % 2 == 0))
            rows.append(_row(i, policy="snapkv", design="poisson", budget=b, head_fraction=0.95, correct=True))
            rows.append(_row(i, policy="tova", design="topk", budget=b, correct=i < 5))
            rows.append(_row(i, policy="tova", design="poisson", budget=b, head_fraction=0.5, correct=i < 5))
            rows.append(_row(i, policy="snapkv", design="topk", budget=b, allocator="adakv", correct=True))
            rows.append(_row(i, policy="snapkv", design="poisson", budget=b, allocator="adakv", head_fraction=0.5,
                             correct=True))
        rows.append(_row(i, policy="full", design="full", budget=1.0, correct=True))
    items = pd.DataFrame(rows)
    items.loc[items["allocator"].isna(), "allocator"] = None
    result = _run("c2", strata.no_cost_per_configuration, Tables(items=items), claims_doc)
    comps = {c["name"]: c for c in result.details["components"]}
    assert set(comps) == {f"poisson_minus_topk[{p},{b}]" for p in
                          ("snapkv,uniform,0.5", "snapkv,uniform,0.95", "tova,uniform,0.5", "snapkv,adakv,0.5")
                          for b in ("0.25", "0.5")}
    assert comps["poisson_minus_topk[snapkv,uniform,0.5,0.25]"]["estimate"] == pytest.approx(-50.0)
    assert comps["poisson_minus_topk[snapkv,uniform,0.95,0.5]"]["estimate"] == pytest.approx(0.0)
    assert comps["poisson_minus_topk[snapkv,uniform,0.5,0.25]"]["verdict"] == "not supported"
    by = result.details["verdict_by"]
    # claims.yaml's rule per factor value: snapkv has a lost component, tova none lost (a constant difference
    # of 0 has a degenerate interval at 0 > -1: supported); the share 0.95 alone is supported.
    assert by["policy"] == {"snapkv": "not supported", "tova": "supported"}
    assert by["head_fraction"] == {"0.5": "not supported", "0.95": "supported"}
    assert by["allocator"] == {"adakv": "supported", "uniform": "not supported"}
    assert result.verdict == "not supported"


def _steps(policy: str, share: float, covered: bool, ratio: float, allocator: str = "uniform") -> list[dict]:
    """Step rows whose certificate sqrt(trace_var / 0.05) is ``ratio`` times the true error when covered (ratio
    > 1), or 1/ratio of it when not; errors grow with the step so that the certificate ranks them exactly."""
    out = []
    for i, budget in ((i, b) for i in range(N_ITEMS) for b in (0.25, 0.5)):
        for step in range(5):
            err = 0.01 * (1 + step + 5 * i) * (2 if budget == 0.25 else 1)
            cert = err * ratio if covered else err / ratio
            out.append({"item_id": f"a/{i}", "model": "a", "data": "synthetic", "task": "t", "seed": 0,
                        "setting": "question_aware", "policy": policy, "design": "poisson", "budget": budget,
                        "allocator": allocator, "head_fraction": share, "step": step, "layer": 0, "kv_head": 0,
                        "trace_var": cert ** 2 * 0.05, "true_err": err})
    return out


def test_c3_per_configuration_reports_coverage_and_relative_width(claims_doc):
    steps = pd.DataFrame([*_steps("snapkv", 0.5, True, 3.0), *_steps("snapkv", 0.95, True, 8.0),
                          *_steps("keydiff", 0.5, False, 2.0)])
    result = _run("c3", strata.coverage_per_configuration, Tables(steps=steps), claims_doc)
    comps = {c["name"]: c for c in result.details["components"]}
    assert comps["coverage[snapkv,uniform,0.95]"]["estimate"] == pytest.approx(1.0)
    assert comps["coverage[keydiff,uniform,0.5]"]["estimate"] == pytest.approx(0.0)
    assert comps["spearman[keydiff,uniform,0.5]"]["estimate"] == pytest.approx(1.0)
    assert result.details["cert_over_true_err_median"] == pytest.approx(
        {"keydiff,uniform,0.5": 0.5, "snapkv,uniform,0.5": 3.0, "snapkv,uniform,0.95": 8.0})
    assert result.details["verdict_by"]["policy"] == {"keydiff": "not supported", "snapkv": "supported"}
    assert result.verdict == "not supported"


def _streaming(rng: np.random.Generator) -> pd.DataFrame:
    """Two models; within each, cache-induced failures have the higher certificates, but model b's
    certificates are 100x model a's, so model a's cache-induced failures rank below model b's inherent ones
    in a pooled ranking."""
    rows = []
    for model, scale in (("a", 1.0), ("b", 100.0)):
        for i in range(N_ITEMS):
            full_right = i % 2 == 0  # even items: the full cache answers, so their failures are cache-induced
            base = {"item_id": f"{model}/{i}", "model": model, "data": "synthetic", "task": "t",
                    "setting": "streaming"}
            rows.append({**base, "policy": "full", "design": "full", "budget": 1.0, "seed": 0, "correct": full_right,
                         "logprob_mean": -0.1, "cert_mean": np.nan, "cert_max": np.nan})
            for seed in range(3):
                cert = scale * ((2.0 if full_right else 1.0) + 0.1 * rng.random())
                rows.append({**base, "policy": "snapkv", "design": "poisson", "budget": 0.25, "seed": seed,
                             "correct": False, "logprob_mean": -rng.random(), "cert_mean": cert,
                             "cert_max": 2 * cert})
    return pd.DataFrame(rows)


def test_c6_ranks_failures_within_each_model(claims_doc):
    items = _streaming(np.random.default_rng(3))
    result = _run("c6", strata.attribution_within_model, Tables(items=items), claims_doc)
    # Within each model every cache-induced failure's certificate is above every inherent one's: AUC 1 exactly.
    # Pooled, model a's cache-induced failures (about 2) rank below model b's inherent ones (about 100):
    # a quarter of the pairs are wrong.
    assert result.details["auc_certificate"]["estimate"] == pytest.approx(1.0)
    assert result.details["classes_by_model"] == {"a": {"n_inherent": 30, "n_cache_induced": 30},
                                                  "b": {"n_inherent": 30, "n_cache_induced": 30}}
    from kvcert.analysis import stats

    failing = items[items["policy"] == "snapkv"]
    labels = failing["item_id"].str.split("/").str[1].astype(int).to_numpy() % 2 == 0
    assert stats.auc(failing["cert_mean"].to_numpy(), labels) == pytest.approx(0.75)


def test_within_model_auc_weights_groups_by_pairs():
    method = strata.discrimination.AUC_METHODS["mann_whitney"]()
    scores = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # group 0: (1 pos > 1 neg); group 1: pos 0,1 vs negs 1,0
    labels = np.array([True, False, True, True, False, False])
    group = np.array([0, 0, 1, 1, 1, 1])
    # group 0: 1 pair, AUC 1; group 1: positives {0, 1} vs negatives {1, 0}: 4 pairs, AUC 0.5 -> (1 + 2) / 5.
    auc = strata.within_model_auc(method, scores, labels, group, np.ones((1, 6)))
    assert auc == pytest.approx([0.6])


def test_c7_gate_fires_within_each_model(claims_doc):
    items = _streaming(np.random.default_rng(4))
    # Recomputation recovers exactly the cache-induced failures (the full cache answers those items).
    result = _run("c7", strata.recompute_within_model, Tables(items=items), claims_doc)
    runs = items[items["policy"] == "snapkv"].copy()
    runs["full"] = runs["item_id"].str.split("/").str[1].astype(int) % 2 == 0
    fired = runs.groupby("model")["cert_mean"].rank(ascending=False) <= 0.25 * 3 * N_ITEMS
    expected = 100 * (fired & runs["full"]).mean()
    assert result.details["accuracy_certificate"]["estimate"] == pytest.approx(expected)
    assert expected == pytest.approx(25.0)  # the top quarter of each model's runs are all cache-induced
    assert result.details["n_runs_by_model"] == {"a": 3 * N_ITEMS, "b": 3 * N_ITEMS}


def test_the_registry_resolves_amendment_5s_choices():
    choices = {"c2_scope": "per_configuration", "c3_scope": "per_configuration", "c6_ranking": "within_model",
               "c7_gating": "within_model", "c5_gating": "within_model"}
    chosen, _ = registry.with_choices(registry.BASES["amendment2"](), choices, "test")
    assert {c: chosen[c].fn.__name__ for c in ("c2", "c3", "c6", "c7")} == {
        "c2": "no_cost_per_configuration", "c3": "coverage_per_configuration",
        "c6": "attribution_within_model", "c7": "recompute_within_model"}
    assert chosen["c3"].tables == ("steps",)


def test_claims_not_decided_per_configuration_read_the_default_configuration_only(claims_doc):
    # C1 through version 5's analysis on items that also hold other allocators and shares equals C1 on the
    # default configuration's rows alone: a Poisson share-0.95 row that is always right, or an AdaKV top-k row
    # that is always wrong, must not move it (they would if C1 pooled them).
    rows = []
    for i in range(N_ITEMS):
        rows.append(_row(i, policy="full", design="full", budget=1.0, correct=True))
        for b in (0.25, 0.5):
            rows.append(_row(i, policy="snapkv", design="topk", budget=b, correct=i % 2 == 0))
            rows.append(_row(i, policy="snapkv", design="poisson", budget=b, correct=i % 4 == 0))
            rows.append(_row(i, policy="snapkv", design="poisson", budget=b, head_fraction=0.95, correct=True))
            rows.append(_row(i, policy="snapkv", design="topk", budget=b, allocator="adakv", correct=False))
    mixed = pd.DataFrame(rows)
    default = mixed[mixed["allocator"].isna() & mixed["head_fraction"].isna()].drop(columns=["allocator",
                                                                                           "head_fraction"])
    chosen, run = registry.analysis(prereg.version(5, ROOT))
    assert not strata.reads_configurations(chosen["c1"].fn) and strata.reads_configurations(chosen["c2"].fn)
    spec = prereg.claim_spec(claims_doc, "c1")
    opts = options_for(spec, claims_doc["conventions"], n_boot=200, seed=1)
    on_mixed = run("c1", Tables(items=mixed), spec, claims_doc["conventions"], opts).to_dict()
    on_default = run("c1", Tables(items=default), spec, claims_doc["conventions"], opts).to_dict()
    assert on_mixed["details"]["components"] == on_default["details"]["components"]
    estimates = {c["name"]: c["estimate"] for c in on_mixed["details"]["components"]}
    assert estimates["accuracy_change[snapkv,topk,0.25]"] == pytest.approx(-50.0)
    assert estimates["accuracy_change[snapkv,poisson,0.25]"] == pytest.approx(-75.0)
    # a table without the columns is that configuration: returned as it is
    assert strata.default_configuration(Tables(items=default)).items is default

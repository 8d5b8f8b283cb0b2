"""Named analysis variants (kvcert.analysis.variants): amendment 4's C5 gate ranks certificates within each model.

Synthetic item tables of two models whose certificates live on different scales (model "b"'s are 100x model
"a"'s), so the pooled gate of versions 1-3 fires only on model b's runs while the within-model gate fires on
the top quarter of each model's runs. The expected numbers are derived here by hand from the tables, not by
the analysis code. Every number here is exploratory test data, never a result.
"""

from __future__ import annotations


import numpy as np
import pandas as pd
import pytest
import yaml

from helpers.prereg import locked_copy
from kvcert.analysis import amendment2, claims, cli, prereg, variants
from kvcert.analysis.claims import Tables
from kvcert.analysis.errors import AnalysisError

N_ITEMS = 8  # per model; 3 seeds -> 24 runs per model, so the top quarter is exactly 6 runs
SEEDS = (0, 1, 2)


def _items(model: str, scale: float, rng: np.random.Generator) -> pd.DataFrame:
    rows = []
    for i in range(N_ITEMS):
        for budget in (0.25, 0.5):
            for seed in SEEDS:
                rows.append({
                    "item_id": f"{model}/{i}", "policy": "snapkv", "design": "poisson", "budget": budget,
                    "seed": seed, "setting": "question_aware", "correct": bool(rng.random() < (0.4 if budget == 0.25 else 0.8)),
                    "logprob_mean": -rng.random(), "cert_mean": scale * rng.random(), "cert_max": scale * 2.0,
                    "model": model, "data": "synthetic",
                })
        rows.append({"item_id": f"{model}/{i}", "policy": "full", "design": "full", "budget": 1.0, "seed": 0,
                     "setting": "question_aware", "correct": True, "logprob_mean": -0.1, "cert_mean": np.nan,
                     "cert_max": np.nan, "model": model, "data": "synthetic"})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def items() -> pd.DataFrame:
    rng = np.random.default_rng(7)
    return pd.concat([_items("a", 1.0, rng), _items("b", 100.0, rng)], ignore_index=True)


def _expected(items: pd.DataFrame, within_model: bool, q: float = 0.25) -> tuple[float, float]:
    """(certificate-gated accuracy, random-gated accuracy) in points, by hand: no ties, so the gate fires
    for exactly the top q of runs (of each model, or of all runs)."""
    low = items[(items["budget"] == 0.25) & (items["policy"] == "snapkv")].copy()
    high = items[(items["budget"] == 0.5) & (items["policy"] == "snapkv")]
    better = high.groupby(["model", "item_id"])["correct"].mean().rename("better")
    low = low.join(better, on=["model", "item_id"])
    low["low"] = low["correct"].astype(float)
    groups = low.groupby("model") if within_model else [(None, low)]
    fired = pd.Series(0.0, index=low.index)
    for _, g in groups:
        n_fire = int(round(q * len(g)))
        fired[g["cert_mean"].sort_values(ascending=False).index[:n_fire]] = 1.0
    gated = (low["low"] + fired * (low["better"] - low["low"])).mean()
    random = low["low"].mean() + q * (low["better"] - low["low"]).mean()
    return 100 * gated, 100 * random


def _spec_conv():
    doc = prereg.load_claims(prereg.find_root())
    return prereg.claim_spec(doc, "c5"), doc["conventions"]


def test_the_within_model_gate_escalates_the_top_quarter_of_each_model(items):
    spec, conv = _spec_conv()
    opts = claims.Options(n_boot=50, seed=1005, alpha=0.05)
    within = variants.escalation_within_model(Tables(items=items), spec, conv, opts)
    pooled = claims.claim_escalation(Tables(items=items), spec, conv, opts)
    gated, random = _expected(items, within_model=True)
    pooled_gated, pooled_random = _expected(items, within_model=False)
    assert within.details["accuracy_certificate"]["estimate"] == pytest.approx(gated, abs=1e-9)
    assert within.details["accuracy_random"]["estimate"] == pytest.approx(random, abs=1e-9)
    assert within.estimate == pytest.approx(gated - random, abs=1e-9)
    # The frozen pooled gate is what the hand derivation without groups gives, and the two gates differ here.
    assert pooled.details["accuracy_certificate"]["estimate"] == pytest.approx(pooled_gated, abs=1e-9)
    assert pooled_random == pytest.approx(random)
    assert abs(gated - pooled_gated) > 1.0
    assert within.details["n_runs_by_model"] == {"a": 3 * N_ITEMS, "b": 3 * N_ITEMS}
    assert within.ci_low <= within.estimate <= within.ci_high


def test_with_one_model_the_within_model_gate_is_the_pooled_gate(items):
    spec, conv = _spec_conv()
    opts = claims.Options(n_boot=30, seed=1005, alpha=0.05)
    one = Tables(items=items[items["model"] == "a"])
    within = variants.escalation_within_model(one, spec, conv, opts)
    pooled = claims.claim_escalation(one, spec, conv, opts)
    for key in ("gain_over_random", "gain_over_confidence", "accuracy_certificate"):
        assert within.details[key] == pooled.details[key]


def test_choices_replace_only_the_claim_they_name():
    registry, run = variants.with_variants(amendment2.REGISTRY, amendment2.run_claim, {"c5_gating": "within_model"}, "doc")
    assert registry["c5"].fn is variants.escalation_within_model
    assert all(registry[c] is amendment2.REGISTRY[c] for c in amendment2.REGISTRY if c != "c5")
    assert variants.with_variants(amendment2.REGISTRY, amendment2.run_claim, None, "doc") == \
        (amendment2.REGISTRY, amendment2.run_claim)
    with pytest.raises(AnalysisError, match="doc: analysis.c5_gating='by_task': unknown; known: within_model"):
        variants.with_variants(amendment2.REGISTRY, amendment2.run_claim, {"c5_gating": "by_task"}, "doc")
    with pytest.raises(AnalysisError, match="doc: analysis.c4_auc: unknown"):
        variants.with_variants(amendment2.REGISTRY, amendment2.run_claim, {"c4_auc": "x"}, "doc")


def test_a_version_4_study_runs_the_variant_the_amendment_names(items, tmp_path):
    """kvcert-claim with prereg_version=4 on a copy of the pre-registration (amendment 4 as committed and locked):
    C5 comes from the named variant, C1 from amendment 2's frozen module; a draft of it could not be locked."""
    root = locked_copy(tmp_path / "repo")
    document = root / prereg.version(4, root).document
    doc = yaml.safe_load(document.read_text())
    assert not prereg.is_draft(doc)
    prereg.verify_lock(root, 4)
    # The same document as a draft refuses to be locked (what kept it unlocked until its pilot was applied).
    draft = tmp_path / "draft"
    locked_copy(draft)
    (draft / "preregistration" / "amendment-4.lock").unlink()
    (draft / prereg.version(4, draft).document).write_text(yaml.safe_dump({**doc, "status": "DRAFT, not locked (a test copy)"}))
    with pytest.raises(prereg.PreregistrationError, match="is a draft"):
        prereg.write_lock(draft, number=4)

    cells = []
    for model in ("a", "b"):
        cell = tmp_path / f"cell-{model}"
        cell.mkdir()
        items[items["model"] == model].to_parquet(cell / "items.parquet")
        cells.append(str(cell))
    base = {"cells": cells, "prereg_root": str(root), "figures": False, "n_boot": 40, "prereg_version": 4}
    c5 = cli.run({**base, "claim": "c5", "out": str(tmp_path / "c5.json")})
    gated, random = _expected(items, within_model=True)
    assert c5.details["analysis_variant"] == {"c5_gating": "within_model"}
    assert c5.details["prereg_version"] == 4
    assert c5.estimate == pytest.approx(gated - random, abs=1e-9)
    assert set(c5.details["by_model"]) == {"a", "b"}
    with pytest.raises(AnalysisError, match="version 4|amendment-4"):
        doc["analysis"] = {"c5_gating": "by_task"}
        document.write_text(yaml.safe_dump(doc))
        cli.run({**base, "claim": "c5", "out": str(tmp_path / "again.json")})


def test_the_registry_derives_each_versions_analysis_from_its_data(items):
    """kvcert.analysis.registry: version 1 gets its frozen module itself; version 4 gets amendment 2's analysis with
    C5 replaced by the named variant, and its C5 result is the frozen kvcert.analysis.variants plumbing's, field for
    field (every claim of every version: tests/test_discrimination.py)."""
    from kvcert.analysis import registry

    root = prereg.find_root()
    # version 1's claims are its frozen module's; run_claim reads the default configuration's rows, which is
    # every row of a table without allocator / head_fraction columns (tests/test_strata.py)
    assert registry.analysis(prereg.version(1, root))[0] == claims.REGISTRY
    live, run_live = registry.analysis(prereg.version(4, root))
    frozen, run_frozen = variants.with_variants(amendment2.REGISTRY, amendment2.run_claim,
                                                {"c5_gating": "within_model"}, "doc")
    assert live["c5"].fn is frozen["c5"].fn is variants.escalation_within_model
    assert sorted(live) == sorted(frozen)
    spec, conv = _spec_conv()
    opts = claims.options_for(spec, conv, n_boot=40, seed=3)
    assert run_live("c5", Tables(items=items), spec, conv, opts).to_dict() == \
        run_frozen("c5", Tables(items=items), spec, conv, opts).to_dict()
    with pytest.raises(AnalysisError, match="x.yaml: analysis.c5_gating='by_task': unknown; known: within_model"):
        registry.with_choices(registry.BASES["amendment2"](), {"c5_gating": "by_task"}, "x.yaml")
    with pytest.raises(ValueError, match="replaces c5, not c4"):
        registry.register_variant("c5_gating", "c4", "other")(variants.escalation_within_model)

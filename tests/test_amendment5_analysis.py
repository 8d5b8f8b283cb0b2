"""Amendment 5's analysis end to end through `kvcert-claims` (kvcert.analysis.cli) on synthetic cells shaped as
its design's: per model a default question-aware cell (two scorers), a cell at certain-head share 0.95 (Poisson
only, every row carrying head_fraction), an AdaKV cell (allocator on every row) and a streaming cell.

Every claim runs under version 5 and draws its figure; C2 and C3 are decided per configuration and the other
claims read the default configuration only (so C1 equals version 4's C1 on the default cells alone); the per-model
results keep each configuration's components, and `kvcert-aggregate` writes results/claims_by_policy.csv.
The pre-registration and the analysis sources are copied as committed, amendment 5's lock included, and the
copy's locks are verified before any claim runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvcert.analysis import aggregate, cli, prereg, synthetic

# make test-full: every claim of version 5 on synthetic cells, figures drawn (about 30 s); make test keeps version 5's
# design and cells (tests/test_amendment5_design.py).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ("c1", "c2", "c3", "c4", "c5", "c6", "c7")


def _v5_copy(dst: Path) -> Path:
    shutil.copytree(ROOT / "preregistration", dst / "preregistration")
    shutil.copytree(ROOT / "src" / "kvcert" / "analysis", dst / "src" / "kvcert" / "analysis",
                    ignore=shutil.ignore_patterns("__pycache__"))
    prereg.verify_lock(dst, 5)
    return dst


def _cells(root: Path, model: str, seed: int) -> dict[str, Path]:
    qa_items, qa_steps = synthetic.make_tables(synthetic.SynthSpec(
        n_items=24, seed=seed, settings=("question_aware",), policies=("snapkv", "tova"), uniform=False,
        model=model, cert_signal=1.0))
    st_items, st_steps = synthetic.make_tables(synthetic.SynthSpec(
        n_items=40, seed=seed + 1, settings=("streaming",), budgets=(0.25,), uniform=False, model=model))
    share = {t: df[(df["policy"] == "full") | (df["design"] == "poisson")].assign(head_fraction=0.95)
             for t, df in (("items", qa_items), ("steps", qa_steps))}
    adakv = {t: df[df["policy"].isin(["full", "snapkv"])].assign(allocator="adakv")
             for t, df in (("items", qa_items), ("steps", qa_steps))}
    # the share-0.95 Poisson rows are always right: C1 would move if it pooled them with the default's
    share["items"] = share["items"].assign(correct=True, score=1.0)
    out = {}
    for name, tables in {"qa": {"items": qa_items, "steps": qa_steps}, "qa-share0.95": share,
                         "qa-adakv": adakv, "streaming": {"items": st_items, "steps": st_steps}}.items():
        d = root / "cells" / f"{name}-{model}"
        d.mkdir(parents=True)
        for t, df in tables.items():
            df.to_parquet(d / f"{t}.parquet", index=False)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = _v5_copy(tmp_path_factory.mktemp("v5"))
    cells = {m: _cells(root, m, 10 * i) for i, m in enumerate(("model-a", "model-b"))}
    dirs = [str(d) for by_name in cells.values() for d in by_name.values()]
    results = {}
    for claim in CLAIMS:
        results[claim] = cli.run({"claim": claim, "cells": dirs, "out": str(root / "claims" / f"{claim}.json"),
                                  "figure_dir": str(root / "figures"), "prereg_root": str(root),
                                  "prereg_version": 5, "n_boot": 100})
    return root, cells, results


def test_every_claim_runs_under_version_5_and_draws_its_figure(study):
    root, _, results = study
    assert set(results) == set(CLAIMS)
    for claim, result in results.items():
        assert result.details["prereg_version"] == 5
        assert (root / "figures" / f"{claim}.png").stat().st_size > 0, claim
    assert results["c2"].details["scope"] == results["c3"].details["scope"] == "per_configuration"
    assert results["c6"].details["ranking"] == "within_model" and results["c7"].details["gating"] == "within_model"


def test_c2_and_c3_have_a_component_per_configuration(study):
    _, _, results = study
    c2 = {c["name"] for c in results["c2"].details["components"]}
    assert c2 == {f"poisson_minus_topk[{c},{b}]" for b in ("0.25", "0.5") for c in
                  ("snapkv,uniform,0.5", "snapkv,uniform,0.95", "tova,uniform,0.5", "snapkv,adakv,0.5",
                   "tova,uniform,0.95")}
    c3 = {c["name"] for c in results["c3"].details["components"]}
    assert {"coverage[snapkv,adakv,0.5]", "spearman[tova,uniform,0.95]"} <= c3
    assert set(results["c3"].details["cert_over_true_err_median"]) >= {"snapkv,uniform,0.95", "snapkv,adakv,0.5"}


def test_other_claims_read_the_default_configuration_only(study, tmp_path):
    root, cells, results = study
    default = [str(by_name[n]) for by_name in cells.values() for n in ("qa", "streaming")]
    c1_v4 = cli.run({"claim": "c1", "cells": default, "out": str(tmp_path / "c1.json"), "figures": False,
                     "prereg_root": str(root), "prereg_version": 4, "n_boot": 100})
    assert results["c1"].details["components"] == c1_v4.details["components"]
    assert results["c1"].n == c1_v4.n


def test_claims_by_policy_table_pools_and_splits_by_model(study, tmp_path):
    root, _, results = study
    aggregate.aggregate([root / "claims" / f"{c}.json" for c in CLAIMS], tmp_path)
    table = pd.read_csv(tmp_path / "claims_by_policy.csv", dtype={"head_fraction": str, "budget": str})
    assert list(table.columns) == aggregate.BY_POLICY_COLUMNS
    assert set(table["claim"]) == {"c2", "c3"} and set(table["model"]) == {"pooled", "model-a", "model-b"}
    pooled = table[table["model"] == "pooled"]
    assert len(pooled[pooled["claim"] == "c2"]) == len(results["c2"].details["components"])
    row = pooled[(pooled["claim"] == "c2") & (pooled["policy"] == "snapkv") & (pooled["allocator"] == "adakv")
                 & (pooled["budget"] == "0.25")].iloc[0]
    component = next(c for c in results["c2"].details["components"]
                     if c["name"] == "poisson_minus_topk[snapkv,adakv,0.5,0.25]")
    assert row["estimate"] == pytest.approx(component["estimate"]) and row["verdict"] == component["verdict"]
    assert row["policy_verdict"] == results["c2"].details["verdict_by"]["policy"]["snapkv"]
    coverage = pooled[(pooled["claim"] == "c3") & (pooled["component"] == "coverage")]
    assert coverage["budget"].isna().all() and coverage["cert_over_true_err_median"].notna().all()
    model_a = table[(table["model"] == "model-a") & (table["claim"] == "c2")]
    assert len(model_a) == len(pooled[pooled["claim"] == "c2"])

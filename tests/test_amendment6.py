"""Amendment 6 (locked) is data: its plan, pilot, power and design rule are named in its YAML, the registry maps the
names to functions, and its pilot's rule picks the certificate's defenses from a coverage table.

The plan is built from preregistration/amendment-6/amendment.yaml through the registry, at a pilot's choice given
here; the pilot rule (``smallest_covering``) and the design rule run on synthetic tables (our own logic: the tables
are made up, and the expected choices are worked out by hand); the C2 and C3 variants that split configurations by
the defenses run on synthetic cells. The end-to-end test (marked slow) runs the pilot itself, smoke-sized, on
SmolLM2 in a throwaway copy of the pre-registration. Every number here is test data, never a result.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvcert.analysis import defended, prereg, registry, strata
from kvcert.analysis.claims import Tables, options_for
from helpers.scripts import workflow_script

ROOT = Path(__file__).resolve().parents[1]
SIX = ROOT / "preregistration" / "amendment-6" / "amendment.yaml"


@pytest.fixture(scope="module")
def scripts():
    return {name: workflow_script(name, register=True) for name in ("pilot", "power", "resize_design")}


@pytest.fixture(scope="module")
def data(scripts):
    return scripts["pilot"].amendment_data(SIX)


def _configurations(resize_design, plan: dict) -> set[tuple[str, str]]:
    """The (scorer, allocator) pairs of an amendment's plan, as resize_design.allocators_of reads them."""
    return {(s, a) for a, scorers in resize_design.allocators_of(plan).items() for s in scorers}


def _population(chosen: dict) -> dict:
    population = yaml.safe_load((ROOT / "preregistration" / "amendment-5" / "population.yaml").read_text())
    return {**population, "chosen": chosen}


def test_amendment_6_is_locked_states_its_plan_and_names_registered_methods(scripts, data):
    v6 = prereg.version(6, ROOT)
    assert not prereg.is_draft(prereg.load_amendment(ROOT, 6)) and (ROOT / v6.lock).is_file()
    prereg.verify_lock(ROOT, 6)
    assert prereg.latest(ROOT) == 6
    frozen = json.loads((ROOT / v6.lock).read_text())["files"]
    for rel in ("population.yaml", "timing.yaml", "power.yaml", "design.yaml", "amendment.yaml"):
        assert f"preregistration/amendment-6/{rel}" in frozen, rel
    assert "src/kvcert/analysis/defended.py" in frozen
    assert not (SIX.parent / "spec.yaml").exists() and "plan" in yaml.safe_load(SIX.read_text())  # no sidecar
    assert data["version"] == 6 and data["amends"]["version"] == 5 and data["date"] == "2026-12-06"
    assert registry.method("pilot", data["pilot"]["method"], "t") is scripts["pilot"].smallest_defense_covering
    assert scripts["pilot"].POPULATION_STEPS["smallest_defense_covering"] == "whole"  # design.smk runs it
    assert registry.method("plan", data["plan"]["method"], "t") is scripts["resize_design"].configuration_cells
    assert registry.method("design", data["plan"]["design"], "t") is scripts["resize_design"].c3_first_then_scale
    assert registry.method("power", data["power"]["method"], "t") is scripts["power"].per_component_span
    # Amendment 5's factors and scorers, unchanged; the analysis splits C2 and C3 by the defenses.
    five = scripts["pilot"].amendment_data(ROOT / "preregistration" / "amendment-5" / "amendment.yaml")
    for key in ("scorers", "allocators", "budgets", "poisson_seeds", "streaming"):
        assert data["plan"][key] == five["plan"][key], key
    assert data["plan"]["factors"][0] == five["plan"]["factors"][0]
    assert dict(v6.choices)["c3_scope"] == "per_configuration_and_defenses"
    assert registry.analysis(v6)[0]["c3"].fn is defended.coverage_per_defense
    assert registry.CONFIGURATION_COLUMNS == {"tail_mix": 0.0, "head_attention_share": 0.0}
    # A fresh pilot seed and fresh study seeds: none is in amendment 5's list of seeds in use.
    in_use = {0, 1, 3, 5, 6, 7, 10, 11, 40, 41, 9001, 9401, 9501, 4242, 9601, 50, 51}
    assert all(str(s) in data["changes"]["items"] for s in in_use) and data["pilot"]["items_seed"] not in in_use
    assert not in_use & set(data["power"]["items_seeds"].values())
    assert {"pilot_results", "design", "deviations"} <= set(data)


def test_the_locked_choice_is_the_rule_applied_to_the_pilots_coverage_table(scripts, data):
    """population.yaml's `chosen` is smallest_covering over its own coverage table (every grid point, every
    configuration of the plan at the pilot's share), and the study's defended cells run that choice."""
    population = yaml.safe_load((SIX.parent / "population.yaml").read_text())
    table = population["defense_pilot"]["coverage"]
    grid = data["pilot"]["grid"]
    assert sorted((r["head_attention_share"], r["tail_mix"]) for r in table) == sorted(
        (float(e), float(t)) for e in grid["head_attention_share"] for t in grid["tail_mix"])
    coverage = {(r["head_attention_share"], r["tail_mix"]):
                {k: v for k, v in r.items() if k not in ("head_attention_share", "tail_mix")} for r in table}
    configurations = {f"{s},{a}" for s, a in _configurations(scripts["resize_design"], data["plan"])}
    assert all(set(row) == configurations for row in coverage.values())
    assert scripts["pilot"].smallest_covering(coverage, float(data["pilot"]["target"])) == population["chosen"]
    design = yaml.safe_load((SIX.parent / "design.yaml").read_text())["reproduce_90_minutes"]["study"]["cells"]
    chosen = population["chosen"]
    both = [c for c in design if c.endswith(f"-lambda{chosen['tail_mix']:g}-eta{chosen['head_attention_share']:g}")]
    assert both and all(f"design_options.tail_mix={chosen['tail_mix']:g}" in design[c]["overrides"] for c in both)

def test_the_plan_crosses_the_shares_with_each_defense_at_the_pilots_choice(scripts, data):
    resize = scripts["resize_design"]
    spec = resize.plan_of(data, "amendment-6")
    population = _population({"tail_mix": 0.2, "head_attention_share": 0.5, "covers": True})
    counts = {f"{k}-{m}": 4 for m in population["models"] for k in resize.KINDS}
    cells = resize.configuration_cells(population, counts, data["power"]["items_seeds"], spec)
    defenses = ["", "-lambda0.2", "-eta0.5", "-lambda0.2-eta0.5"]
    shares = ["", "-share0.8", "-share0.95"]
    qa = sorted(c for c in cells if c.startswith("qa-smollm2") and "kv" not in c)
    assert qa == sorted(f"qa-smollm2{s}{d}" for s in shares for d in defenses)
    assert len([c for c in cells if c.startswith("oracle-")]) == 2 * 3 * 3 * 4  # models x allocators x shares x 4
    both = cells["oracle-gemma3-pyramidkv-share0.95-lambda0.2-eta0.5"]["overrides"]
    assert {"design_options.tail_mix=0.2", "design_options.head_attention_share=0.5",
            "design_options.head_fraction=0.95", "allocator=pyramidkv", "policies=[snapkv]", "designs=[poisson]",
            "data.seed=61"} <= set(both)
    # The undefended cells are amendment 5's, override for override (no defense key at its default).
    assert not any("tail_mix" in o or "attention_share" in o for o in cells["qa-smollm2-share0.8"]["overrides"])
    assert sorted(c for c in cells if "designs=[topk,poisson]" in cells[c]["overrides"]) == sorted(
        f"qa-{m}{a}" for m in ("smollm2", "gemma3") for a in ("", "-adakv", "-pyramidkv"))  # top-k: no defense
    # A chosen 0 leaves that defense out: the cells are the undefended ones (no duplicate, no lambda0 name).
    zero = resize.configuration_cells(_population({"tail_mix": 0.0, "head_attention_share": 1.0}), counts,
                                      data["power"]["items_seeds"], spec)
    assert sorted(c for c in zero if c.startswith("oracle-smollm2-share0.8")) == [
        "oracle-smollm2-share0.8", "oracle-smollm2-share0.8-eta1"]


def test_the_pilots_cells_and_cost_come_from_the_data(scripts, data):
    pilot = scripts["pilot"]
    cells = pilot.defense_pilot_cells(data, _population({}))
    grid = data["pilot"]["grid"]
    assert len(cells) == 2 * 3 * len(grid["head_attention_share"]) * len(grid["tail_mix"])
    assert all(c["kind"] == "oracle" for c in cells.values())
    one = cells["oracle-smollm2-share0.8-lambda0.5-eta1"]["overrides"]
    assert {"design_options.head_fraction=0.8", "design_options.tail_mix=0.5", "design_options.head_attention_share=1",
            "seeds=[0]", "data.seed=9602", "n_items=8", "designs=[poisson]", "oracle=true"} <= set(one)
    cost = pilot.defense_pilot_cost(data, cells, ROOT)
    timing = yaml.safe_load((ROOT / data["pilot"]["cost_from"]).read_text())["measured"]
    by_hand = 8 / 3 * 12 * sum(timing[f"oracle-{m}{a}-share0.8"]["per_item_median"]
                               for m in ("smollm2", "gemma3") for a in ("", "-adakv", "-pyramidkv"))
    assert cost["cell_seconds"] == round(by_hand) and cost["wall_minutes"] == round(by_hand / 2 / 60, 1)
    assert cost["wall_minutes"] < 30  # the pilot fits well under an hour on 2 cores (the amendment's rule)


def test_the_pilot_rule_takes_the_smallest_point_eta_first(scripts):
    rule = scripts["pilot"].smallest_covering
    low, high = {"cur,uniform": 0.90, "snapkv,uniform": 0.97}, {"cur,uniform": 0.96, "snapkv,uniform": 0.97}
    table = {(0.0, 0.0): low, (0.0, 0.2): low, (0.0, 1.0): high, (0.5, 0.0): high, (0.5, 0.2): high, (1.0, 0.0): high}
    # eta first: (eta 0, lambda 1) comes before (eta 0.5, lambda 0), so it is chosen although lambda is larger.
    assert rule(table, 0.95) == {"head_attention_share": 0.0, "tail_mix": 1.0, "covers": True, "smallest_coverage": 0.96}
    del table[(0.0, 1.0)]
    assert rule(table, 0.95) == {"head_attention_share": 0.5, "tail_mix": 0.0, "covers": True, "smallest_coverage": 0.96}
    # Exactly at the target covers; one configuration below it does not.
    assert rule({(0.0, 0.0): {"a": 0.95, "b": 0.99}}, 0.95)["covers"] is True
    # None covers: the largest smallest coverage, the earlier point on a tie, covers false.
    none = {(0.0, 0.0): {"a": 0.80, "b": 0.99}, (0.0, 0.5): {"a": 0.90, "b": 0.91},
            (1.0, 0.0): {"a": 0.93, "b": 0.90}, (1.0, 0.5): {"a": 0.91, "b": 0.99}}
    assert rule(none, 0.95) == {"head_attention_share": 1.0, "tail_mix": 0.5, "covers": False, "smallest_coverage": 0.91}
    tie = {(0.5, 0.0): {"a": 0.9}, (0.0, 0.5): {"a": 0.9}}
    assert rule(tie, 0.95)["head_attention_share"] == 0.0
    with pytest.raises(SystemExit, match=r"^pilot coverage: grid point eta=0.5, lambda=0 lacks b$"):
        rule({(0.0, 0.0): {"a": 0.9, "b": 0.9}, (0.5, 0.0): {"a": 0.99}}, 0.95)


def _step_table(path: Path, policy: str, covered: list[bool], allocator: str | None = None, **defenses) -> None:
    """A pilot cell's steps.parquet (our own made-up rows): one step row per entry, certificate 2x the error when
    covered and half of it when not."""
    rows = [{"policy": policy, "design": "poisson", "true_err": 0.1, "trace_var": (0.2 if c else 0.05) ** 2 * 0.05,
             **({"allocator": allocator} if allocator else {}), **defenses} for c in covered]
    rows.append({"policy": "full", "design": "full", "true_err": float("nan"), "trace_var": float("nan"), **defenses})
    path.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(path / "steps.parquet")


def test_the_pilots_coverage_pools_models_per_scorer_allocator_and_grid_point(scripts, tmp_path):
    pilot = scripts["pilot"]
    _step_table(tmp_path / "oracle-a-share0.8" / "shard-0", "cur", [True, False, False, False])
    _step_table(tmp_path / "oracle-b-share0.8" / "shard-0", "cur", [True, True, True, True])
    _step_table(tmp_path / "oracle-a-share0.8-eta1" / "shard-0", "cur", [True] * 4, head_attention_share=1.0)
    _step_table(tmp_path / "oracle-a-adakv-share0.8-lambda0.5" / "shard-0", "snapkv", [True, False], allocator="adakv",
                tail_mix=0.5)
    names = sorted(p.name for p in tmp_path.iterdir())
    got = pilot.pilot_coverage(tmp_path, names, 0.05)
    assert got == {(0.0, 0.0): {"cur,uniform": 5 / 8}, (1.0, 0.0): {"cur,uniform": 1.0},
                   (0.0, 0.5): {"snapkv,adakv": 0.5}}


def test_the_90_minute_design_puts_c3_first(scripts, data):
    resize = scripts["resize_design"]
    spec = resize.plan_of(data, "amendment-6")
    population = _population({"tail_mix": 0.2, "head_attention_share": 0.5})
    power = {"per_model": {"question_aware": 1396, "oracle": 124, "streaming": 261, "streaming_c6_floor": 97}}
    full = {f"{k}-{m}": 1 for m in population["models"] for k in resize.KINDS}
    timing = {c: {"per_item_median": 1.0} for c in resize.configuration_cells(population, full, {"qa": 1, "oracle": 1,
                                                                                               "streaming": 1}, spec)}
    out = resize.c3_first_then_scale(data, spec, population, power, timing, 7800.0, data["power"]["items_seeds"],
                                     resize.configuration_cells)
    counts = out["reproduce_90_minutes"]["counts"]
    # Per model: 36 qa cells (one top-k), 36 oracle cells, 1 streaming cell, each 1 s per item; qa 4 and streaming
    # 16 items kept: 2 * (36 * 4 + 16) = 320 s; the oracle cells share 7480 s at 72 s per item pair: 103 per model.
    assert out["cost_per_item"]["qa-smollm2"] == 36.0 and out["cost_per_item"]["oracle-gemma3"] == 36.0
    assert counts == {"oracle-gemma3": 103, "oracle-smollm2": 103, "qa-gemma3": 4, "qa-smollm2": 4,
                      "streaming-gemma3": 16, "streaming-smollm2": 16}
    assert out["powered"]["counts"]["oracle-smollm2"] == 124 and out["fits"] is False
    study = out["reproduce_90_minutes"]["study"]
    assert study["prereg"] == 6 and "n_items=103" in study["cells"]["oracle-smollm2-share0.8-lambda0.2-eta0.5"]["overrides"]


# --- the analysis: C2 and C3 per configuration, split by the defenses ---------------------------------------------

N = 12


def _steps(policy: str, share: float, covered, ratio: float = 2.0, **defenses) -> list[dict]:
    out = []
    for i in range(N):
        for budget in (0.25, 0.5):
            for step in range(4):
                err = 0.01 * (1 + step + 4 * i)
                ok = covered(i) if callable(covered) else covered
                cert = err * ratio if ok else err / ratio
                out.append({"item_id": f"a/{i}", "model": "a", "data": "synthetic", "task": "t", "seed": 0,
                            "setting": "question_aware", "policy": policy, "design": "poisson", "budget": budget,
                            "head_fraction": share, "step": step, "layer": 0, "kv_head": 0,
                            "trace_var": cert ** 2 * 0.05, "true_err": err, **defenses})
    return out


def _run(claim: str, fn, tables: Tables):
    doc = prereg.load_claims(ROOT)
    spec = prereg.claim_spec(doc, claim)
    return fn(tables, spec, doc["conventions"], options_for(spec, doc["conventions"], n_boot=100, seed=1))


def test_c3_splits_each_configuration_by_its_defenses():
    steps = pd.DataFrame([*_steps("snapkv", 0.5, True), *_steps("cur", 0.8, lambda i: i % 2 == 0),
                          *_steps("cur", 0.8, True, 3.0, head_attention_share=0.5),
                          *_steps("cur", 0.8, lambda i: i < 9, tail_mix=0.2, head_attention_share=0.5)])
    result = _run("c3", defended.coverage_per_defense, Tables(steps=steps))
    comps = {c["name"]: c["estimate"] for c in result.details["components"] if c["name"].startswith("coverage")}
    assert comps == pytest.approx({"coverage[snapkv,uniform,0.5]": 1.0, "coverage[cur,uniform,0.8]": 0.5,
                                   "coverage[cur+eta0.5,uniform,0.8]": 1.0,
                                   "coverage[cur+lambda0.2+eta0.5,uniform,0.8]": 0.75})
    assert result.details["cert_over_true_err_median"]["cur+eta0.5,uniform,0.8"] == pytest.approx(3.0)
    assert result.details["verdict_by"]["policy"]["cur+eta0.5"] == "supported"
    assert result.details["verdict_by"]["policy"]["cur"] == "not supported"
    # Without defense columns, the variant is amendment 5's.
    plain = pd.DataFrame([*_steps("snapkv", 0.5, True), *_steps("cur", 0.8, lambda i: i % 2 == 0)])
    a = _run("c3", defended.coverage_per_defense, Tables(steps=plain))
    b = _run("c3", strata.coverage_per_configuration, Tables(steps=plain))
    assert a.details["components"] == b.details["components"]


def test_c2_pairs_a_defended_poisson_with_its_scorers_topk_and_reports_it_against_the_undefended():
    rows = []
    for i in range(N):
        base = {"item_id": f"a/{i}", "model": "a", "data": "synthetic", "task": "t", "seed": 0,
                "setting": "question_aware", "logprob_mean": -0.5, "cert_mean": 1.0, "cert_max": 2.0}
        for b in (0.25, 0.5):
            rows.append({**base, "policy": "snapkv", "design": "topk", "budget": b, "correct": True})
            rows.append({**base, "policy": "snapkv", "design": "poisson", "budget": b, "head_fraction": 0.5,
                         "correct": i % 2 == 0})
            rows.append({**base, "policy": "snapkv", "design": "poisson", "budget": b, "head_fraction": 0.5,
                         "tail_mix": 0.2, "correct": i % 4 != 0})
        rows.append({**base, "policy": "full", "design": "full", "budget": 1.0, "correct": True})
    result = _run("c2", defended.no_cost_per_defense, Tables(items=pd.DataFrame(rows)))
    comps = {c["name"]: c["estimate"] for c in result.details["components"]}
    assert comps == pytest.approx({f"poisson_minus_topk[{p},uniform,0.5,{b}]": v for b in ("0.25", "0.5")
                                   for p, v in (("snapkv", -50.0), ("snapkv+lambda0.2", -25.0))})
    versus = result.details["defended_minus_undefended"]
    assert set(versus) == {"snapkv+lambda0.2,uniform,0.5,0.25", "snapkv+lambda0.2,uniform,0.5,0.5"}
    assert versus["snapkv+lambda0.2,uniform,0.5,0.25"]["estimate"] == pytest.approx(25.0)
    assert versus["snapkv+lambda0.2,uniform,0.5,0.25"]["n"] == N


# --- the pilot itself, smoke-sized, end to end -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.smollm2
def test_the_defense_pilot_runs_from_data_in_a_throwaway_copy(tmp_path, scripts):
    """A copy of the pre-registration with amendment 6's document, its pilot smoke-sized as data (SmolLM2, two
    scorers, the uniform allocator, a 2 x 2 grid, one item, budget 0.25): pilot.py runs the method the document
    names, its cells through kvcert-run, and writes population.yaml with the reused population, the choice and the
    coverage table; the choice is the rule's on that table."""
    from test_amendment_from_data import _copy

    root = _copy(tmp_path / "repo", upto=5)
    doc = yaml.safe_load(SIX.read_text())
    doc["status"] = "DRAFT: a throwaway copy, its pilot not yet run (as amendment 6 was when its pilot ran)"
    doc["plan"] = {**doc["plan"], "scorers": {"snapkv": "SnapKVPress", "cur": "CURPress"},
                   "allocators": {"uniform": "scorers"}, "budgets": [0.25]}
    doc["pilot"] = {**doc["pilot"], "models": ["smollm2"], "n_items": 1,
                    "grid": {"head_attention_share": [0.0, 1.0], "tail_mix": [0.0, 0.5]}}
    folder = root / "preregistration" / "amendment-6"
    folder.mkdir()
    (folder / "amendment.yaml").write_text(yaml.safe_dump(doc, sort_keys=False, width=110))
    done = subprocess.run([sys.executable, str(ROOT / "workflow" / "scripts" / "pilot.py"), "--method",
                           "smallest_defense_covering", "--amendment", str(folder / "amendment.yaml"),
                           "--cells", str(tmp_path / "cells"), "--out", str(folder / "population.yaml")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pilot: 4 oracle cells x 1 items, estimated" in done.stderr
    population = yaml.safe_load((folder / "population.yaml").read_text())
    assert list(population["models"]) == ["smollm2"]
    assert population["reused_from"] == "preregistration/amendment-4/population.yaml"
    table = population["defense_pilot"]["coverage"]
    assert [(r["head_attention_share"], r["tail_mix"]) for r in table] == [(0.0, 0.0), (0.0, 0.5), (1.0, 0.0), (1.0, 0.5)]
    assert all(set(r) == {"head_attention_share", "tail_mix", "cur,uniform", "snapkv,uniform"} for r in table)
    assert all(0.0 <= r["cur,uniform"] <= 1.0 for r in table)
    coverage = {(r["head_attention_share"], r["tail_mix"]): {k: v for k, v in r.items() if "," in k} for r in table}
    expected = scripts["pilot"].smallest_covering(coverage, 0.95)
    assert {k: population["chosen"][k] for k in ("head_attention_share", "tail_mix", "covers")} == {
        k: expected[k] for k in ("head_attention_share", "tail_mix", "covers")}
    steps = pd.read_parquet(tmp_path / "cells" / "oracle-smollm2-share0.8-lambda0.5-eta1" / "shard-0" / "steps.parquet")
    poisson = steps[steps["design"] == "poisson"]
    assert set(poisson["tail_mix"]) == {0.5} and set(poisson["head_attention_share"]) == {1.0}


PENDING_SCALE = """outdir: results
models:
  smollm2: [model=smollm2]
studies:
  v6:
    pending:
      until: ../../preregistration/amendment-6/amendment.lock
      why: amendment 6 is a draft awaiting its pilot
    design:
      file: ../../preregistration/amendment-6/design.yaml
      study: reproduce_90_minutes.study
"""


def test_v6_scale_computes_the_locked_design_and_a_pending_study_waits_for_its_lock(tmp_path):
    """The default scale computes study v6 from amendment 6's locked design (make reproduce). The pending mechanism
    that kept it out before the lock (our own logic, on a made-up scale and design in a throwaway folder): a study
    pending until a file exists runs nothing before it, and is read from its design after."""
    from kvcert.scales import ScaleError, load_scale, scales_folder, studies

    scales = scales_folder(ROOT)
    got = studies(load_scale("default", scales))["v6"]
    design = yaml.safe_load((ROOT / "preregistration" / "amendment-6" / "design.yaml").read_text())
    assert got["prereg"] == 6 and list(got["cells"]) == list(design["reproduce_90_minutes"]["study"]["cells"])
    assert "pending" not in load_scale("default", scales)["studies"]["v6"]
    copy = tmp_path / "configs" / "scales"
    copy.mkdir(parents=True)
    (copy / "v6.yaml").write_text(PENDING_SCALE)
    folder = tmp_path / "preregistration" / "amendment-6"
    folder.mkdir(parents=True)
    cell = {"model": "smollm2", "shards": 1, "overrides": ["n_items=2"]}
    (folder / "design.yaml").write_text(yaml.safe_dump({"reproduce_90_minutes": {"study": {
        "prereg": 6, "cells": {"oracle-smollm2": cell}}}}))
    assert studies(load_scale("v6", copy)) == {}  # a design alone (before the lock) runs nothing
    (folder / "amendment.lock").write_text("{}")
    got = studies(load_scale("v6", copy))["v6"]
    assert got["prereg"] == 6 and list(got["cells"]) == ["oracle-smollm2"]
    (copy / "v6.yaml").write_text(PENDING_SCALE.replace("      why: amendment 6", "      reason: x"))
    with pytest.raises(ScaleError, match=r"^v6.yaml: study v6: pending=.*expected a mapping of until and why$"):
        load_scale("v6", copy)


def test_the_paper_scale_applies_amendment_6_with_the_pilots_defenses():
    """configs/scales/paper.yaml: study paper under prereg 6, its defended cells (matrix variant `defended`,
    question-aware only) SnapKV Poisson at the locked choice, every undefended cell as before."""
    from kvcert.scales import load_scale, parse_overrides, scales_folder, studies

    paper = studies(load_scale("paper", scales_folder(ROOT)))["paper"]
    chosen = yaml.safe_load((SIX.parent / "population.yaml").read_text())["chosen"]
    assert paper["prereg"] == 6 == prereg.latest(ROOT)
    defended = {name: cell for name, cell in paper["cells"].items() if name.endswith("-defended")}
    assert defended and all("-question_aware-" in name for name in defended)
    for name, cell in defended.items():
        base = paper["cells"][name.removesuffix("-defended")]
        assert cell["overrides"][: len(base["overrides"])] == base["overrides"]
        values = parse_overrides(cell["overrides"])
        assert values["designs"] == ["poisson"] and values["extra_grids"] == [] and values["policies"] == ["snapkv"]
        assert values["design_options.tail_mix"] == chosen["tail_mix"]
        assert values["design_options.head_attention_share"] == chosen["head_attention_share"]


def test_every_v6_cell_ran_after_the_lock():
    """The lock predates every committed v6 cell: each manifest records the clean commit it ran from, and the commit
    that added amendment 6's lock is an ancestor of it (a cell cannot record a commit made after it ran)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    if git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("a shallow clone lacks the history the check reads")
    lock = git("log", "--diff-filter=A", "--format=%H", "--", "preregistration/amendment-6/amendment.lock").stdout.split()
    assert len(lock) == 1, f"want one commit that added amendment 6's lock, got {lock}"
    manifests = sorted((ROOT / "results" / "v6" / "cells").glob("*/shard-*/manifest.json"))
    design = yaml.safe_load((ROOT / "preregistration" / "amendment-6" / "design.yaml").read_text())
    cells = design["reproduce_90_minutes"]["study"]["cells"]
    assert len(manifests) == sum(cell.get("shards", 1) for cell in cells.values())  # every shard of the locked design
    sources = [json.loads(p.read_text())["source"] for p in manifests]
    assert not any(source["dirty"] for source in sources)
    for commit in {source["commit"] for source in sources}:
        assert git("merge-base", "--is-ancestor", lock[0], commit).returncode == 0, (
            f"v6 cells ran from {commit}, which does not descend from the lock's commit {lock[0]}")


def test_claims_by_policy_holds_c3_for_every_configuration_with_and_without_each_defense(scripts):
    """results/claims_by_policy.csv, study v6, pooled over both models: C3's coverage and Spearman for every
    (scorer, allocator) of amendment 6's plan, every certain-head share, without a defense, with each alone and with
    both at the locked choice; each with a verdict and the per-scorer verdict beside it."""
    doc = yaml.safe_load(SIX.read_text())
    chosen = yaml.safe_load((SIX.parent / "population.yaml").read_text())["chosen"]
    plan = doc["plan"]
    pairs = _configurations(scripts["resize_design"], plan)
    shares = next(f["values"] for f in plan["factors"] if f["label"] == "share")
    lam, eta = f"+lambda{chosen['tail_mix']:g}", f"+eta{chosen['head_attention_share']:g}"
    table = pd.read_csv(ROOT / "results" / "claims_by_policy.csv")
    c3 = table[(table["study"] == "v6") & (table["claim"] == "c3") & (table["model"] == "pooled")]
    got = {(p, a, float(h), c) for p, a, h, c in zip(c3["policy"], c3["allocator"], c3["head_fraction"], c3["component"])}
    want = {(s + d, a, float(h), c) for s, a in pairs for d in ("", lam, eta, lam + eta) for h in shares
            for c in ("coverage", "spearman")}
    assert len(pairs) == 14 and got == want
    assert c3["verdict"].isin(["supported", "not supported", "inconclusive"]).all() and c3["policy_verdict"].notna().all()

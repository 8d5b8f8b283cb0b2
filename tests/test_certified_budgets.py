"""The exploratory certified-budgets analysis (workflow/scripts/certified_budgets.py) on small synthetic cell tables
(no model): accuracy, kept memory, the per-layer coverage of ε and the prediction-vs-decode gap against numbers
computed by hand below. Every number here is test data, never a result."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvcert.analysis.accuracy import accuracy_points
from kvcert.analysis.exploratory import load_cell_table
from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.stats import auc
from kvcert.scales import scales_folder

ROOT = Path(__file__).resolve().parents[1]


def _workflow_script(name: str):
    """workflow/scripts/<name>.py as a module (Snakemake runs it as a script; its functions are tested here)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "workflow" / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _workflow_script("certified_budgets")


@pytest.fixture(scope="module")
def figure_script():
    return _workflow_script("certified_budgets_figure")


KEYS = dict(seed=0, setting="question_aware")


def item(item_id, policy, design, budget, correct, retained, **extra):
    return {"item_id": item_id, "policy": policy, "design": design, "budget": budget, "correct": correct,
            "retained_tokens": retained, "context_tokens": 100, "full_bytes": 1000, "cache_bytes": 9999, **KEYS,
            **extra}


def steps(item_id, design, budget, layer, errors, norm=1.0, certs=None):
    """certs: the rows' relative certificates (rel_cert); None: a design without one (NaN, as top-k and clt)."""
    return pd.DataFrame({"item_id": item_id, "policy": "snapkv", "design": design, "budget": budget, **KEYS,
                         "step": np.arange(len(errors)), "layer": layer, "kv_head": 0,
                         "true_err": np.asarray(errors, dtype=np.float32), "out_norm": np.float32(norm),
                         "rel_cert": np.asarray(np.full(len(errors), np.nan) if certs is None else certs,
                                                dtype=np.float32)})


@pytest.fixture()
def cells(tmp_path):
    target = tmp_path / "target" / "shard-0"
    fixed = tmp_path / "fixed" / "shard-0"
    target.mkdir(parents=True)
    fixed.mkdir(parents=True)
    pd.DataFrame([item("a", "full", "full", 1.0, True, 100), item("b", "full", "full", 1.0, True, 100),
                  item("a", "snapkv", "poisson", 0.5, True, 20), item("b", "snapkv", "poisson", 0.5, False, 40),
                  item("a", "snapkv", "clt", 0.5, False, 100), item("b", "snapkv", "clt", 0.5, False, 100)]
                 ).to_parquet(target / "items.parquet")
    # layer 0 (‖ô‖ = 1), e = 0.05, 0.095, 0.2, 0.01: e/‖o‖ lies in [e/1.05, e/0.95], [e/1.095, e/0.905], ...
    #   certainly <= 0.1: 0.05 (<= 0.0527), 0.01 -> 2/4; possibly: also 0.095 (>= 0.0868) -> 3/4; e/‖ô‖: 3/4
    # layer 1: e = 0, 0.3, 2.0 (e > ‖ô‖: unbounded above) -> 1/3 in every form
    # the same cell's clt rows (the decode-time sampler keeps the whole cache): layer 0, e = 0.5, 0.01
    # their certificates (rel_cert): layer 0 flags (> 0.1) only the row e = 0.095, layer 1 only e = 0.3
    pd.concat([steps("a", "poisson", 0.5, 0, [0.05, 0.095, 0.2, 0.01], certs=[0.04, 0.2, 0.05, 0.01]),
               steps("a", "poisson", 0.5, 1, [0.0, 0.3, 2.0], certs=[0.01, 0.5, 0.05]),
               steps("a", "clt", 0.5, 0, [0.5, 0.01])], ignore_index=True).to_parquet(target / "steps.parquet")
    pd.DataFrame([{"item_id": "a", "policy": "snapkv", "design": "poisson", "budget": 0.5, **KEYS, "layer": layer,
                   "kv_head": 0, "expected_count": count, "cap_count": 50, "context_tokens": 100, "retained": count,
                   "predicted_rel_cert": cert, "met": met}
                  for layer, count, cert, met in ((0, 20, 0.08, True), (1, 50, 0.4, False))]
                 ).to_parquet(target / "targets.parquet")
    pd.DataFrame([item("a", "full", "full", 1.0, True, 100), item("b", "full", "full", 1.0, True, 100),
                  item("a", "snapkv", "topk", 0.25, True, 25), item("b", "snapkv", "topk", 0.25, True, 25)]
                 ).to_parquet(fixed / "items.parquet")
    steps("a", "topk", 0.25, 0, [0.01, 0.5]).to_parquet(fixed / "steps.parquet")
    # the recorded configs (kvcert.runner.cell.config_yaml): keys at what their absence means are left out
    (target / "config.yaml").write_text("target_error: 0.1\ntarget_delta: 0.05\n")
    (fixed / "config.yaml").write_text("budgets:\n- 0.25\n")
    return {"m-target_0.1": {"model": "m", "variant": "target_0.1", "dirs": [str(target)]},
            "m-fixed": {"model": "m", "variant": "fixed", "dirs": [str(fixed)]}}


def recorded(spec, tmp_path, name, **config):
    """A copy of a cell spec whose shard records ``config`` (its tables as the spec's)."""
    shard = tmp_path / name / "shard-0"
    shutil.copytree(spec["dirs"][0], shard)
    (shard / "config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in config.items()))
    return {**spec, "dirs": [str(shard)]}


def test_tables_match_a_hand_computation(script, cells, tmp_path):
    out = tmp_path / "out"
    script.main(cells, [0.1, 0.05], 0.05, out)
    # exactly the tables rule certified_budgets declares as outputs (exploratory.smk's CERTIFIED_TABLES)
    rule = (ROOT / "workflow" / "rules" / "exploratory.smk").read_text()
    declared = ast.literal_eval(re.search(r"^CERTIFIED_TABLES = (\(.*?\))$", rule, re.M | re.S).group(1))
    assert sorted(p.stem for p in out.iterdir()) == sorted(declared)
    summary = pd.read_csv(out / "summary.csv").set_index("configuration")
    assert list(summary.index) == ["full", "target 0.1", "clt 0.1", "fixed topk 0.25"]  # the full cache once per model
    assert summary.loc["clt 0.1", ["accuracy", "kept_fraction", "coverage_stored_0.1"]].tolist() == \
        pytest.approx([0.0, 1.0, 0.5])
    assert summary.loc["target 0.1", "accuracy"] == pytest.approx(50.0)
    assert summary.loc["target 0.1", "kept_fraction"] == pytest.approx(0.3)  # (20 + 40) / 2 / 100
    # no kept_bytes column and cache_bytes padded: full_bytes · retained / context
    assert summary.loc["target 0.1", "kept_bytes"] == pytest.approx(300.0)
    assert summary.loc["fixed topk 0.25", "coverage_stored_0.1"] == pytest.approx(0.5)

    layers = pd.read_csv(out / "coverage_by_layer.csv")
    target = layers[layers["configuration"] == "target 0.1"].set_index("layer")
    assert set(target["epsilon"]) == {0.1}  # a target is measured at its own ε only
    assert target.loc[0, ["coverage_low", "coverage_high", "coverage_stored"]].tolist() == pytest.approx([0.5, 0.75, 0.75])
    assert target.loc[1, ["coverage_low", "coverage_high", "coverage_stored"]].tolist() == pytest.approx([1 / 3] * 3)
    assert target["level"].tolist() == pytest.approx([0.95, 0.95])
    assert layers[layers["configuration"] == "clt 0.1"]["epsilon"].tolist() == [0.1]  # at its own ε, as a target
    fixed = layers[layers["configuration"] == "fixed topk 0.25"]
    assert sorted(fixed["epsilon"]) == [0.05, 0.1]  # a fixed budget is measured at every study ε

    by_step = pd.read_csv(out / "coverage_by_step.csv")
    target = by_step[by_step["configuration"] == "target 0.1"].set_index("step")
    # step 0: layer 0's e = 0.05 and layer 1's e = 0, both certainly within 0.1; step 1: 0.095 possibly, 0.3 not;
    # step 2: 0.2 and 2.0, neither; step 3: layer 0's 0.01 alone
    assert target["n_step_rows"].tolist() == [2, 2, 2, 1]
    assert target["coverage_low"].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0])
    assert target["coverage_high"].tolist() == pytest.approx([1.0, 0.5, 0.0, 1.0])
    assert set(target["epsilon"]) == {0.1} and target["level"].tolist() == pytest.approx([0.95] * 4)
    assert sorted(by_step[by_step["configuration"] == "fixed topk 0.25"]["epsilon"].unique()) == [0.05, 0.1]

    gap = pd.read_csv(out / "targets.csv")
    assert set(gap["configuration"]) == {"target 0.1"}  # clt chooses nothing at prefill: no prediction to check
    overall = gap[gap["layer"] == "all"].iloc[0]
    assert overall["heads_met"] == pytest.approx(0.5)
    assert overall["expected_fraction"] == pytest.approx(0.35)  # (20 + 50) / 2 / 100
    # only layer 0's head was predicted to meet ε: of its 4 rows, 0.2 is certainly above 0.1, 0.095 possibly
    assert overall["n_met_step_rows"] == 4
    assert [overall["exceed_low"], overall["exceed_high"], overall["exceed_stored"]] == pytest.approx([0.25, 0.5, 0.25])
    assert overall["met_heads_exceeding"] == pytest.approx(1.0)
    # layer 1's head missed ε (it keeps the cap): its rows e = 0, 0.3, 2.0 are within 0.1 once, in either form
    assert overall["n_capped_step_rows"] == 3
    assert [overall["capped_coverage_low"], overall["capped_coverage_high"]] == pytest.approx([1 / 3, 1 / 3])
    layer0 = gap[gap["layer"] == "0"].iloc[0]
    assert layer0["n_capped_step_rows"] == 0 and np.isnan(layer0["capped_coverage_low"])


def test_error_bounds_bracket_the_error_relative_to_the_full_output(script):
    rng = np.random.default_rng(0)
    o = rng.normal(size=(200, 8))
    o_hat = o + rng.normal(scale=rng.uniform(0.01, 2.0, size=(200, 1)), size=(200, 8))
    e = np.linalg.norm(o_hat - o, axis=1)
    low, high, stored = script.error_bounds(e, np.linalg.norm(o_hat, axis=1))
    truth = e / np.linalg.norm(o, axis=1)
    assert np.all(low <= truth + 1e-12) and np.all(truth <= high + 1e-12)
    assert np.isinf(high).any()  # some errors exceed ‖ô‖: no finite upper bound there
    assert stored == pytest.approx(e / np.linalg.norm(o_hat, axis=1))


def test_a_target_cell_without_its_choice_table_is_named(script, cells, tmp_path):
    (Path(cells["m-target_0.1"]["dirs"][0]) / "targets.parquet").unlink()
    with pytest.raises(AnalysisError, match="targets.parquet: missing"):
        script.main(cells, [0.1], 0.05, tmp_path / "out")


def test_a_target_at_another_cap_is_named_by_its_cap_and_drawn_as_its_own_family(script, figure_script):
    # The study's targets (variant target_<eps>) keep their names; the uncapped cells' targets (budget 1.0) would
    # otherwise share them and be pooled with the capped ones in every table.
    assert script.configuration_name("target_0.1", "poisson", 0.5, 0.1) == "target 0.1"
    assert script.configuration_name("uncapped_0.1", "poisson", 1.0, 0.1) == "target 0.1 cap 1"
    # families from the columns, not the cell's name: (design, budget, target error, floor, allocator)
    families = [script.family(*columns) for columns in
                (("poisson", 0.5, 0.05, np.nan, "uniform"), ("clt", 0.5, 0.05, np.nan, "uniform"),
                 ("poisson", 1.0, 0.05, np.nan, "uniform"), ("topk", 0.25, np.nan, np.nan, "adakv"),
                 ("topk", 0.25, np.nan, np.nan, "uniform"), ("poisson", 0.5, 0.1, 0.25, "uniform"))]
    assert families == ["target", "clt", "uncapped", "adakv", "fixed", "floored"]
    assert set(figure_script.TARGET_FAMILIES) <= set(figure_script.FAMILY_COLORS)


def test_a_floored_target_is_named_by_its_floor_and_kept_apart_from_the_unfloored_one(script, figure_script, cells,
                                                                                     tmp_path):
    # A floored_<eps> cell (target_floor set) at the same eps and cap as a target_<eps> cell: its rows must not be
    # pooled with the unfloored ones in any table. Here the floored cell reads the same tables, so its rows equal
    # the target's row for row under its own name.
    assert script.configuration_name("floored_0.1", "poisson", 0.5, 0.1, 0.25) == "target 0.1 floor 0.25"
    assert script.configuration_name("other_0.1", "poisson", 1.0, 0.1, 0.25) == "target 0.1 floor 0.25 cap 1"
    assert script.configuration_name("target_0.1", "poisson", 0.5, 0.1, np.nan) == "target 0.1"
    assert script.family("poisson", 0.5, 0.1, 0.25, "uniform") in figure_script.TARGET_FAMILIES
    floored = recorded({**cells["m-target_0.1"], "variant": "floored_0.1"}, tmp_path, "floored", target_error=0.1,
                       target_delta=0.05, target_floor=0.25)
    both = {**cells, "m-floored_0.1": floored}
    script.main(both, [0.1], 0.05, tmp_path / "out")
    summary = pd.read_csv(tmp_path / "out" / "summary.csv").set_index("configuration")
    assert summary.loc["target 0.1", "n_items"] == summary.loc["target 0.1 floor 0.25", "n_items"] == 2
    numbers = ["accuracy", "kept_fraction", "n_step_rows", "coverage_low_0.1", "coverage_high_0.1"]
    assert summary.loc["target 0.1", numbers].equals(summary.loc["target 0.1 floor 0.25", numbers])
    targets = pd.read_csv(tmp_path / "out" / "targets.csv")
    by = targets[targets["layer"] == "all"].set_index("configuration")
    assert by.loc["target 0.1", "n_heads"] == by.loc["target 0.1 floor 0.25", "n_heads"] == 2


def diagnostics(cells, epsilons, delta, out):
    """The diagnostics notebook's tables (its code cells: kvcert.analysis.certified's load, then
    kvcert.analysis.certificate_diagnostics), written as it writes them."""
    from kvcert.analysis import certificate_diagnostics as diag
    from kvcert.analysis.certified import load, with_bounds

    items, steps, choices = load(cells)
    steps = with_bounds(steps)
    out.mkdir(parents=True, exist_ok=True)
    for name, table in {"certificate_flags": diag.certificate_flags(choices, steps, epsilons, delta),
                        "certificate_items": diag.certificate_items(items, steps, epsilons),
                        "certificate_heads": diag.certificate_heads(choices, steps, epsilons)}.items():
        (out / f"{name}.csv").write_text(table.round(6).to_csv(index=False))


def test_certificate_flags_match_a_hand_computation(script, cells, tmp_path):
    out = tmp_path / "out"
    diagnostics(cells, [0.1, 0.05], 0.05, out)
    flags = pd.read_csv(out / "certificate_flags.csv")
    # only the poisson rows carry a certificate (top-k and clt have none), measured at the target's own ε
    assert set(flags["configuration"]) == {"target 0.1"} and set(flags["epsilon"]) == {0.1}
    assert set(flags["sizing"]) == {"target"} and set(flags["family"]) == {"target"}
    by = flags.set_index("layer")
    # 7 rows: certainly above 0.1 are layer 0's e = 0.2 and layer 1's 0.3 and 2.0; possibly also layer 0's 0.095.
    # Flagged: layer 0's 0.095 and layer 1's 0.3. So of the 3 rows certainly above, 1 is caught; 2 rows above (in
    # either form) are silent.
    overall = by.loc["all"]
    assert overall["n_step_rows"] == 7
    assert overall[["above_low", "above_high", "flagged", "caught", "silent_low", "silent_high"]].tolist() == \
        pytest.approx([3 / 7, 4 / 7, 2 / 7, 1 / 3, 2 / 7, 2 / 7])
    # the met head (layer 0) has 4 decode rows, one flagged: the prediction's miss the certificate reports
    assert overall["n_met_step_rows"] == 4 and overall["met_flagged"] == pytest.approx(0.25)
    assert by.loc["0", ["caught", "silent_low", "silent_high"]].tolist() == pytest.approx([0.0, 0.25, 0.25])
    assert by.loc["1", "n_met_step_rows"] == 0 and np.isnan(by.loc["1", "met_flagged"])
    assert flags["level"].tolist() == pytest.approx([0.95] * 3)

    heads = pd.read_csv(out / "certificate_heads.csv").set_index("layer")
    assert set(heads["configuration"]) == {"target 0.1"} and len(heads) == 2
    # layer 0: e = 0.05, 0.095, 0.2, 0.01 (mean 0.08875), certificates mean 0.075, one row flagged, one certainly
    # above (0.2, not flagged: silent); it keeps 20 of 100 and met ε
    assert heads.loc[0, ["n_step_rows", "rel_err_mean", "rel_cert_mean", "flagged", "above_low", "silent_low",
                         "kept_fraction", "heads_met", "rank"]].tolist() == \
        pytest.approx([4, 0.08875, 0.075, 0.25, 0.25, 0.25, 0.2, 1.0, 2], abs=1e-6)  # the table's 6 decimals
    # layer 1: e = 0, 0.3, 2.0 (mean 0.7667, the largest: rank 1); 0.3 flagged, 2.0 silent; it keeps the cap, 50
    assert heads.loc[1, ["rel_err_mean", "rel_cert_mean", "flagged", "above_low", "silent_low", "kept_fraction",
                         "heads_met", "rank"]].tolist() == \
        pytest.approx([2.3 / 3, 0.56 / 3, 1 / 3, 2 / 3, 1 / 3, 0.5, 0.0, 1], abs=1e-6)


def test_certificate_flags_of_a_fixed_budget_at_every_study_level(script):
    s = steps("a", "poisson", 0.25, 0, [0.02, 0.07, 0.2], certs=[0.03, 0.08, 0.3]).assign(
        model="m", configuration="adakv poisson 0.25", variant="adakv", target_error=np.nan, family="adakv")
    s["err_low"], s["err_high"], s["err_stored"] = script.error_bounds(s["true_err"].to_numpy(),
                                                                       s["out_norm"].to_numpy())
    from kvcert.analysis import certificate_diagnostics as diag

    flags = diag.certificate_flags(pd.DataFrame(), s, [0.1, 0.05], 0.05)
    overall = flags[flags["layer"] == "all"].set_index("epsilon")
    assert sorted(overall.index) == [0.05, 0.1]
    assert set(overall["sizing"]) == {"fixed"} and set(overall["family"]) == {"adakv"}
    # at 0.1: e = 0.2 certainly above and flagged; at 0.05: 0.07 too (0.07/1.07 > 0.05), flagged (0.08)
    columns = ["above_low", "flagged", "caught", "silent_low"]
    assert overall.loc[0.1, columns].tolist() == pytest.approx([1 / 3, 1 / 3, 1, 0])
    assert overall.loc[0.05, columns].tolist() == pytest.approx([2 / 3, 2 / 3, 1, 0])
    assert overall["n_met_step_rows"].tolist() == [0, 0] and overall["met_flagged"].isna().all()
    heads = diag.certificate_heads(pd.DataFrame(), s, [0.1, 0.05])
    assert len(heads) == 2 and heads["kept_fraction"].isna().all() and heads["rank"].tolist() == [1, 1]


def test_certificate_items_score_wrong_answers_by_their_share_of_flagged_rows(script):
    # Four items of one fixed Poisson configuration, two decode rows each (‖ô‖ = 1). Items c and d are wrong.
    # Flagged (rel_cert > 0.1): a 0 of 2, b 1, c 1, d 2 -> right items 0.25, wrong 0.75. Over the four (wrong,
    # right) pairs the wrong item scores higher three times and ties once (c, b): AUC (1 + 1 + 1 + 0.5) / 4.
    # Certainly above 0.1 (e/(1 + e) > 0.1): only a's second row; the right item a beats both wrong ones and
    # b ties them: AUC (0 + 0 + 0.5 + 0.5) / 4.
    certs = {"a": [0.05, 0.05], "b": [0.2, 0.05], "c": [0.05, 0.3], "d": [0.2, 0.3]}
    errors = {"a": [0.01, 0.5], "b": [0.01, 0.01], "c": [0.01, 0.01], "d": [0.01, 0.01]}
    s = pd.concat([steps(i, "poisson", 0.5, 0, errors[i], certs=certs[i]) for i in certs], ignore_index=True).assign(
        model="m", configuration="fixed poisson 0.5", variant="fixed", target_error=np.nan, family="fixed")
    s["err_low"], s["err_high"], s["err_stored"] = script.error_bounds(s["true_err"].to_numpy(),
                                                                       s["out_norm"].to_numpy())
    items = pd.DataFrame([item(i, "snapkv", "poisson", 0.5, i in ("a", "b"), 50) for i in certs]).assign(
        model="m", configuration="fixed poisson 0.5")
    from kvcert.analysis import certificate_diagnostics as diag

    table = diag.certificate_items(items, s, [0.1])
    row = table.iloc[0]
    assert len(table) == 1 and row["n_items"] == 4 and row["n_wrong"] == 2
    assert row[["flagged_right", "flagged_wrong", "above_right", "above_wrong"]].tolist() == \
        pytest.approx([0.25, 0.75, 0.25, 0.0])
    assert row["auc_flagged"] == pytest.approx(0.875) and row["auc_above"] == pytest.approx(0.25)
    # every item right: no AUC
    same = diag.certificate_items(items.assign(correct=True), s, [0.1]).iloc[0]
    assert same["n_wrong"] == 0 and np.isnan(same["auc_flagged"]) and np.isnan(same["flagged_wrong"])


# --- the floor each committed cell ran with ---------------------------------------------------------------------

CERTIFIED_SCALES = sorted(p.stem for p in scales_folder(ROOT).glob("certified-budgets*.yaml"))


@pytest.mark.parametrize("name", CERTIFIED_SCALES)
def test_every_target_cell_of_a_certified_scale_resolves_to_the_floor_it_ran_with(name):
    """The floor at half the cap is the default since the held-out checks; the certified scales' targets ran
    without one (target_floor=null) or with 0.25 (the floored_<eps> cells). Each target cell's run config, composed
    from the scale as the cell rule composes it, has that floor, and where the cell is committed its config.yaml is
    written byte for byte as committed and reads back to the same target."""
    import yaml

    from kvcert.run_schema import HALF_CAP
    from kvcert.runner.cell import config_yaml
    from kvcert.runner.config import validate
    from kvcert.scales import cell_config, exploratory, load_scale, parse_overrides

    scale = load_scale(name, scales_folder(ROOT))
    compared, bare_checked = 0, False
    for study, spec in exploratory(scale).items():
        for cell, c in spec["cells"].items():
            overrides = parse_overrides(c["overrides"])
            if overrides.get("target_error") is None:
                continue
            assert "target_floor" in overrides, f"{name}: {cell} names no target_floor"
            want = 0.25 if spec["variant"][cell].startswith("floored") else None
            out_dir = ROOT / scale["outdir"] / study / "cells" / cell / "shard-0"
            cfg = cell_config(scale, c, ["shard=0", f"n_shards={c['shards']}",
                                         f"threads={scale.get('threads_per_cell', 1)}",
                                         f"out_dir={out_dir.relative_to(ROOT).as_posix()}"])
            target = validate(cfg).target
            assert target.floor == want and target.floor != HALF_CAP, f"{name}: {cell}"
            committed = out_dir / "config.yaml"
            if committed.is_file():
                assert config_yaml(cfg) == committed.read_text(), committed
                assert validate(yaml.safe_load(committed.read_text())).target == target, committed
                compared += 1
            if want is None and not bare_checked:  # without its override an unfloored cell would have the default
                bare = cell_config(scale, {**c, "overrides": [o for o in c["overrides"]
                                                              if not o.startswith("target_floor=")]})
                assert validate(bare).target.floor == HALF_CAP
                bare_checked = True
    committed_cells = [path for study in exploratory(scale)
                       for path in (ROOT / scale["outdir"] / study / "cells").glob("*/shard-*/config.yaml")]
    assert compared == sum("target_error:" in path.read_text() for path in committed_cells)  # every one compared


def test_a_target_cell_at_the_default_floor_is_named_by_the_floor_of_its_cap(script, cells, tmp_path):
    # A future target cell that names no floor runs with half its cap (the rule's target_floor: half_cap): its
    # rows are named by that floor, apart from an unfloored target's.
    defaulted = recorded(cells["m-target_0.1"], tmp_path, "defaulted", target_error=0.1, target_delta=0.05,
                         target_floor="half_cap")
    script.main({**cells, "m-target_0.1": defaulted}, [0.1], 0.05, tmp_path / "out")
    summary = pd.read_csv(tmp_path / "out" / "summary.csv").set_index("configuration")
    assert "target 0.1 floor 0.25 cap 0.5" in summary.index and "target 0.1" not in summary.index
    assert "clt 0.1" in summary.index  # the same cell's clt rows keep their name


def test_the_analysis_package_reads_and_scores_what_the_script_tabulates(script, cells, tmp_path):
    """The script reads cells, accuracy and AUCs through kvcert.analysis: a missing column of a table it reads is
    named by load_cell_table; accuracy is the claims' per-item mean over seeds, then over items (an item answered right
    on one seed of two counts one half, not one); the AUC is stats.auc's, ties counted one half."""
    target_dir = Path(cells["m-target_0.1"]["dirs"][0])
    frame = pd.read_parquet(target_dir / "steps.parquet").drop(columns=["out_norm"])
    frame.to_parquet(target_dir / "steps.parquet")
    with pytest.raises(AnalysisError, match=r"steps.parquet: missing column\(s\) out_norm"):
        script.main(cells, [0.1], 0.05, tmp_path / "out")
    assert len(load_cell_table([target_dir], "steps", ["true_err"])) == 9  # only what the caller names is required
    seeds = pd.DataFrame({"model": "m", "item_id": ["a", "a", "b", "b"], "seed": [0, 1, 0, 1],
                          "correct": [True, False, True, True]})
    assert accuracy_points(seeds.iloc[[0, 1, 2]]) == pytest.approx(75.0)  # (0.5 + 1) / 2; its rows give 66.7
    assert np.isnan(accuracy_points(seeds.iloc[:0]))
    assert auc([0.2, 0.2, 0.9, 0.1], [True, False, True, False]) == pytest.approx((0.5 + 1 + 1 + 1) / 4)


def test_configurations_are_the_recorded_configs_columns_not_the_cells_names(script, cells, tmp_path):
    """A cell's target error, delta, floor and allocator come from its config.yaml, whatever the cell is called: a
    target cell named like a fixed one is still a target; a renamed cell with an allocator is that allocator's
    family; a missing or disagreeing config is named."""
    renamed = {"m-odd": recorded({**cells["m-target_0.1"], "variant": "fixed_odd"}, tmp_path, "odd",
                                 target_error=0.1, target_delta=0.05),
               "m-other": recorded({**cells["m-fixed"], "variant": "other"}, tmp_path, "other", allocator="adakv")}
    items, steps, choices = script.load(renamed)
    poisson = items[(items["design"] == "poisson")].iloc[0]
    assert (poisson["configuration"], poisson["family"], poisson["target_delta"]) == ("target 0.1", "target", 0.05)
    topk = items[items["design"] == "topk"].iloc[0]
    assert (topk["configuration"], topk["family"], topk["allocator"]) == ("other topk 0.25", "adakv", "adakv")
    assert set(items.loc[items["policy"] == "full", "allocator"]) == {"uniform"}
    assert len(choices) == 2  # the target's choice table is read because its config has a target error
    (Path(renamed["m-other"]["dirs"][0]) / "config.yaml").unlink()
    with pytest.raises(AnalysisError, match=r"other/shard-0/config.yaml: missing"):
        script.load(renamed)
    second = Path(renamed["m-odd"]["dirs"][0]).parent / "shard-1"
    import shutil

    shutil.copytree(renamed["m-odd"]["dirs"][0], second)
    (second / "config.yaml").write_text("target_error: 0.05\n")
    with pytest.raises(AnalysisError, match=r"shard-1/config.yaml: .* differs from the cell's other shards'"):
        script.recorded_config([*renamed["m-odd"]["dirs"], str(second)])


def test_no_configuration_is_parsed_from_a_name():
    """The analysis scripts label and group configurations by columns: no startswith/split on a name."""
    for path in [*(ROOT / "workflow" / "scripts" / f"{name}.py" for name in ("certified_budgets", "heldout_check",
                                                                          "heldout_paired")),
                 *(ROOT / "src" / "kvcert" / "analysis" / f"{name}.py" for name in ("certified", "heldout",
                                                                                   "certificate_diagnostics"))]:
        source, name = path.read_text(), path.name
        assert ".startswith(" not in source and ".split(\"_\")" not in source and ".split('_')" not in source, name


def test_the_diagnostics_notebook_writes_the_tables_its_module_computes(cells, tmp_path):
    """The notebook's code cells (workflow/notebooks/certified_diagnostics.py.ipynb), run in-process with the
    object Snakemake's notebook directive gives them, write exactly the diagnostics module's tables and show the
    figure that rule certificate_flags_figure draws from the flags table (one panel per model)."""
    import json
    from types import SimpleNamespace

    notebook = json.loads((ROOT / "workflow" / "notebooks" / "certified_diagnostics.py.ipynb").read_text())
    out = tmp_path / "nb"
    out.mkdir()
    names = ("certificate_flags", "certificate_items", "certificate_heads")
    namespace = {"snakemake": SimpleNamespace(
        params=SimpleNamespace(cells=cells, epsilons=[0.1, 0.05], delta=0.05),
        output=SimpleNamespace(**{name: str(out / f"{name}.csv") for name in names}))}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec("".join(cell["source"]), namespace)  # noqa: S102 (our own notebook)
    diagnostics(cells, [0.1, 0.05], 0.05, tmp_path / "module")
    for name in names:
        assert (out / f"{name}.csv").read_text() == (tmp_path / "module" / f"{name}.csv").read_text(), name
    assert len(namespace["fig"].axes) == 1  # one model: one panel
    module = _workflow_script("certificate_flags_figure")
    module.main(out / "certificate_flags.csv", 0.05, tmp_path / "flags.png", tmp_path / "flags.pdf")
    assert (tmp_path / "flags.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pd.read_csv(out / "certificate_flags.csv").drop(columns=["family"]).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(AnalysisError, match=r"bad.csv: no column family"):
        module.main(tmp_path / "bad.csv", 0.05, tmp_path / "flags.png", tmp_path / "flags.pdf")


def test_the_figure_is_drawn_from_the_tables_with_the_families_the_cells_give(script, figure_script, cells,
                                                                              tmp_path):
    """Rule certified_budgets_figure reads summary.csv, coverage_by_step.csv and the cells' recorded configs only:
    each configuration's family from the table's columns and the recorded floor equals the one the cells' reader
    (kvcert.analysis.certified.load) gives from the parquet tables, for an unfloored, a floored and a default-floored
    target, clt, the fixed budgets and the full cache; the figure is drawn with no parquet table present."""
    floored = recorded({**cells["m-target_0.1"], "variant": "floored_0.1"}, tmp_path, "floored", target_error=0.1,
                       target_delta=0.05, target_floor=0.25)
    defaulted = recorded({**cells["m-target_0.1"], "variant": "defaulted_0.1"}, tmp_path, "defaulted",
                         target_error=0.1, target_delta=0.05, target_floor="half_cap")
    both = {**cells, "m-floored_0.1": floored, "m-defaulted_0.1": defaulted}
    out = tmp_path / "out"
    script.main(both, [0.1], 0.05, out)
    items = script.load(both)[0]
    from_cells = items.groupby(["model", "configuration"], sort=False)["family"].first().to_dict()
    summary = pd.read_csv(out / "summary.csv")
    from_tables = figure_script.families(summary, both).set_index(["model", "configuration"])["family"].to_dict()
    assert from_tables == from_cells
    assert sorted(set(from_tables.values())) == ["clt", "fixed", "floored", "full", "target"]
    for spec in both.values():  # the figure needs no parquet table
        for table in Path(spec["dirs"][0]).glob("*.parquet"):
            table.unlink()
    png, pdf = tmp_path / "fig" / "f.png", tmp_path / "fig" / "f.pdf"
    figure_script.main(out / "summary.csv", out / "coverage_by_step.csv", both, [0.1], 0.05, png, pdf)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pdf.read_bytes()[:5] == b"%PDF-"
    first = png.read_bytes()
    figure_script.main(out / "summary.csv", out / "coverage_by_step.csv", both, [0.1], 0.05, png, pdf)
    assert png.read_bytes() == first  # a redraw of the same tables writes the same bytes

    with pytest.raises(AnalysisError, match="names variant 'floored_0.1', which no cell"):
        figure_script.families(summary, cells)
    summary.drop(columns=["variant"]).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(AnalysisError, match=r"bad.csv: no column variant"):
        figure_script.main(tmp_path / "bad.csv", out / "coverage_by_step.csv", both, [0.1], 0.05, png, pdf)
    with pytest.raises(AnalysisError, match=r"nothing.csv: missing"):
        figure_script.main(tmp_path / "nothing.csv", out / "coverage_by_step.csv", both, [0.1], 0.05, png, pdf)


@pytest.mark.slow  # make test-full: a Snakemake run over a copy of the floor scale's committed results
def test_make_redraw_draws_the_committed_figures_from_the_committed_tables(tmp_path):
    """`make redraw`'s Snakemake call (its rules read from the Makefile) on a copy of the floor scale's committed
    results holding no parquet table: only the figure rule runs, no cell or table is touched, and the figure it draws
    is the committed one byte for byte (the committed figures are the current code's drawing of the committed
    tables). Fails where the figure code changes and the committed figures were not redrawn."""
    scale = "certified-budgets-floor"
    makefile = (ROOT / "Makefile").read_text()
    rules = re.search(r"^REDRAW_RULES := (.+)$", makefile, re.M).group(1).split()
    recipe = re.search(r"^redraw:.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "--allowed-rules $(REDRAW_RULES) --forcerun $(REDRAW_RULES) -- redraw" in recipe
    results = ROOT / "results" / scale
    copied = tmp_path / "results" / scale
    shutil.copytree(results, copied, ignore=shutil.ignore_patterns("*.parquet", "notebooks"))
    before = {p: p.read_bytes() for p in copied.rglob("*") if p.is_file()}
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "snakemake"), "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
                           "--cores", "1", "--config", f"scale={scale}", "--allowed-rules", *rules,
                           "--forcerun", *rules, "--", "redraw"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = sorted(set(re.findall(r"^rule (\w+):", proc.stderr, re.M)) | set(re.findall(r"^localrule (\w+):",
                                                                                          proc.stderr, re.M)))
    assert ran == ["certificate_flags_figure", "certified_budgets_figure", "redraw"], proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in copied.rglob("*") if p.is_file()} == before  # no table rewritten
    for figure in ("certified-budgets.png", "certificate_flags.png"):
        drawn = tmp_path / "paper_figures" / scale / "certified-budgets" / figure
        committed = ROOT / "paper_figures" / scale / "certified-budgets" / figure
        assert drawn.read_bytes() == committed.read_bytes(), f"{figure}: not the code's drawing: make redraw"

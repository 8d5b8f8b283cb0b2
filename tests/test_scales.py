"""Scale files: the rehearsal derives from the paper scale by substitution only, and the Snakefile,
kvcert-plan and the derivation expand a scale the same way."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from kvcert.scales import (
    ScaleError,
    cell_config,
    cell_overrides,
    derive,
    expand_cells,
    load_scale,
    longbench_subsets,
    needs_longbench_copy,
    override_value,
    parse_overrides,
    scales_folder,
    shard_list,
    studies,
    study_cells,
    substitute_overrides,
)

ROOT = Path(__file__).resolve().parents[1]
SCALES = scales_folder(ROOT)


def _keys(overrides: list[str]) -> list[str]:
    return [o.split("=", 1)[0] for o in overrides]


def test_rehearsal_keeps_the_paper_matrix_grid_and_claims():
    paper_scale, rehearse_scale = load_scale("paper", SCALES), load_scale("rehearse", SCALES)
    # the claims study's matrix, expanded with the scale's models and grid (kvcert.scales.studies does so)
    paper = {**paper_scale, **paper_scale["studies"]["paper"]}
    rehearse = {**rehearse_scale, **rehearse_scale["studies"]["paper"]}
    raw = yaml.safe_load((SCALES / "rehearse.yaml").read_text())
    assert raw["base"] == "paper" and set(raw) <= {"base", "purpose", "substitute"}
    assert rehearse["grid"] == paper["grid"]
    assert rehearse["claims_scale"] == "paper"
    for key in ("models", "settings", "shards"):
        assert rehearse["matrix"][key] == paper["matrix"][key]
    assert list(rehearse["matrix"]["data"]) == list(paper["matrix"]["data"])
    # every data and model override of the paper is still there, in order; only values (and data.path) change
    for name, overrides in paper["matrix"]["data"].items():
        derived = rehearse["matrix"]["data"][name]
        assert _keys(derived)[: len(overrides)] == _keys(overrides)
        assert set(_keys(derived)) - set(_keys(overrides)) <= {"data.path"}
        assert override_value(derived, "data") == override_value(overrides, "data")
        assert override_value(derived, "data.tasks") == override_value(overrides, "data.tasks")
    for model, overrides in paper["models"].items():
        derived = rehearse["models"][model]
        assert _keys(derived) == _keys(overrides)
        assert override_value(derived, "model.dtype") == override_value(overrides, "model.dtype") == "bfloat16"  # paper.yaml
    # the same cells and shards, under the same names
    paper_cells, rehearse_cells = expand_cells(paper), expand_cells(rehearse)
    assert list(paper_cells) == list(rehearse_cells)
    assert shard_list(paper_cells) == shard_list(rehearse_cells)
    matrix = paper["matrix"]  # models x data x (settings + each variant's settings) cells, each in its shards
    variant_settings = sum(len(v["settings"]) for v in (matrix.get("variants") or {}).values())
    assert len(shard_list(paper_cells)) == (len(matrix["models"]) * len(matrix["data"])
                                            * (len(matrix["settings"]) + variant_settings) * matrix["shards"])
    # every rehearsal cell has at least one item per shard, and the lengths are scaled down
    for cell in rehearse_cells.values():
        overrides = cell_overrides(rehearse, cell)
        assert int(override_value(overrides, "n_items")) >= cell["shards"]


def test_a_change_of_the_paper_scale_reaches_the_rehearsal(tmp_path):
    shutil.copytree(SCALES, tmp_path / "scales")
    paper_file = tmp_path / "scales" / "paper.yaml"
    paper = yaml.safe_load(paper_file.read_text())
    paper["grid"] = [g.replace("budgets=[0.1,0.25,0.5,0.75]", "budgets=[0.2,0.4]") for g in paper["grid"]]
    paper["studies"]["paper"]["matrix"]["settings"] = ["streaming"]
    paper["studies"]["paper"]["matrix"]["variants"]["defended"]["settings"] = ["streaming"]
    paper["studies"]["paper"]["matrix"]["data"]["ruler"].append("data.haystack=prose")
    paper_file.write_text(yaml.safe_dump(paper, sort_keys=False))
    rehearse_scale = load_scale("rehearse", tmp_path / "scales")
    rehearse = {**rehearse_scale, **rehearse_scale["studies"]["paper"]}
    assert "budgets=[0.2,0.4]" in rehearse["grid"]
    assert rehearse["matrix"]["settings"] == ["streaming"]
    assert override_value(rehearse["matrix"]["data"]["ruler"], "data.haystack") == "prose"
    assert override_value(rehearse["matrix"]["data"]["ruler"], "data.context_tokens") == 800  # rehearse.yaml's substitute
    names = list(expand_cells(rehearse))
    assert all(name.endswith(("-streaming", "-streaming-defended")) for name in names)
    assert sum(name.endswith("-defended") for name in names) == len(names) / 2  # the variant follows the paper's


def test_the_leaderboard_study_is_tabulated_beside_the_paper_study():
    """Cells paper/<model>-<data>-<setting> (not named after study v2); the leaderboard's cells are exploratory
    (no claim reads them) on Qwen3-8B at RULER 4k, kvpress's ratios as budgets, both designs, and AdaKV."""
    for name in ("paper", "rehearse"):
        scale = load_scale(name, SCALES)
        assert list(studies(scale)) == ["paper"]
        cells = study_cells(scale)
        assert {study for study, _ in cells} == {"paper", "leaderboard"}
        board = {cell: cell_overrides(scale, spec) for (study, cell), spec in cells.items() if study == "leaderboard"}
        assert set(board) == {"query_agnostic", "query_agnostic_pyramidkv", "query_aware", "query_aware_adakv"}
        for cell, overrides in board.items():
            assert override_value(overrides, "model.name") == (
                "Qwen/Qwen3-8B" if name == "paper" else "results/rehearse/standins/models/qwen3")
            assert override_value(overrides, "budgets") == [0.75, 0.5, 0.25, 0.125]
            assert override_value(overrides, "designs") == ["topk", "poisson"]
            assert override_value(overrides, "setting") == ("question_aware" if "aware" in cell.split("_")
                                                            else "streaming")
        assert override_value(board["query_aware_adakv"], "allocator") == "adakv"
        assert override_value(board["query_aware"], "allocator") is None
    paper = load_scale("paper", SCALES)
    assert override_value(cell_overrides(paper, study_cells(paper)[("leaderboard", "query_agnostic")]),
                          "data.context_tokens") == 4096


def test_substitution_rules():
    base = {"outdir": "a", "models": {"m": ["model=hf", "model.name=x"]}, "resources": {"cell": {"mem_mb": 1}}}
    out = derive(base, {"models.m": {"model.name": "y", "model.device": "cpu"}, "outdir": "b",
                        "resources.cell": {"mem_mb": 2}})
    assert out["models"]["m"] == ["model=hf", "model.name=y", "model.device=cpu"]
    assert out["outdir"] == "b" and out["resources"]["cell"] == {"mem_mb": 2}
    assert base["models"]["m"] == ["model=hf", "model.name=x"]  # the base is not modified
    with pytest.raises(ScaleError, match=r"substitute\.models\.other: not in the base scale"):
        derive(base, {"models.other": ["model=hf"]}, where="x.yaml")
    with pytest.raises(ScaleError, match=r"substitute\.matrix\.shards: matrix is not in the base scale"):
        derive(base, {"matrix.shards": 2}, where="x.yaml")
    with pytest.raises(ScaleError, match="has a mapping here"):
        derive(base, {"resources": 3})
    assert substitute_overrides(["a=1", "+b=2"], {"b": [1, 2], "c": True}) == ["a=1", "b=[1,2]", "c=true"]


# A templated study (amendments 2 and 3) and its template: one model m, one kind qa.
TEMPLATED = "models: {{m: [model=x]}}\nstudies: {{s: {{prereg: 2, template: t.{tfile}, counts: {{file: {counts}, key: {key}}}, shards: {{qa-m: 2}}, fill: {{seed: [data.seed=3]}}}}}}\n"
TEMPLATE = "models: {m: {fill: {task: [data.tasks=x]}}}\nkinds: {qa: {count: question_aware, overrides: ['{task}', '{seed}', 'n_items={items}']}}\n"


def test_a_templated_study_fills_its_template_and_reads_its_counts(tmp_path):
    (tmp_path / "a.yaml").write_text(TEMPLATED.format(tfile="yaml", counts="c.yaml", key="n"))
    (tmp_path / "t.yaml").write_text(TEMPLATE)
    (tmp_path / "c.yaml").write_text("n: {m: {question_aware: 7}}\n")  # by model and count key
    cell = studies(load_scale("a", tmp_path))["s"]["cells"]["qa-m"]
    assert dict(cell) == {"model": "m", "shards": 2, "overrides": ["data.tasks=x", "data.seed=3", "n_items=7"]}
    (tmp_path / "c.yaml").write_text("n: {qa-m: 5, m: {question_aware: 7}}\n")  # the cell's own count first
    assert studies(load_scale("a", tmp_path))["s"]["cells"]["qa-m"]["overrides"][-1] == "n_items=5"


BAD_SCALES = {  # name -> (files written, the message)
    "loop": ({"a": "base: b\n", "b": "base: a\n"}, "base chain loops"),
    "no-base": ({"a": "substitute: {outdir: x}\n"}, "'substitute' needs a 'base'"),
    "unknown-base": ({"a": "base: nope\n"}, "scale=nope: unknown scale"),
    "own-cells": ({"a": "base: b\ncells: {}\n", "b": "outdir: x\n"}, "a.yaml: cells: a derived scale lists only"),
    "design-missing": ({"a": "studies: {s: {design: {file: d.yml, study: x.study}}}\n"},
                       r"a.yaml: study s: design.file=d.yml: no such file \(paths are relative to the scale file\)"),
    "design-key": ({"a": "studies: {s: {design: {file: a.yaml, study: x.study}}}\n"},
                   "a.yaml: study s: design.study=x.study: x is not in a.yaml"),
    "design-and-cells": ({"a": "studies: {s: {prereg: 4, design: {file: a.yaml, study: x}}}\n"},
                         "a.yaml: study s: design: prereg: a study that applies a design takes its prereg and cells"),
    "design-shape": ({"a": "studies: {s: {design: d.yaml}}\n"}, "a.yaml: study s: design='d.yaml': expected a mapping"),
    "template-keys": ({"a": "studies: {s: {prereg: 2, template: t.yaml, counts: {file: c.yaml, key: n}}}\n"},
                      "a.yaml: study s: shards: a templated study takes prereg, template, counts, shards"),
    "template-missing": ({"a": TEMPLATED.format(tfile="yml", counts="c.yaml", key="n"), "c": "n: {qa-m: 3}\n"},
                         r"a.yaml: study s: template=t.yml: no such file \(paths are relative to the scale file\)"),
    "template-count": ({"a": TEMPLATED.format(tfile="yaml", counts="c.yaml", key="n"), "c": "n: {qa-other: 3}\n", "t": TEMPLATE},
                       "a.yaml: study s: cell qa-m: c.yaml n has no count for qa-m nor for m.question_aware"),
    "template-key": ({"a": TEMPLATED.format(tfile="yaml", counts="c.yaml", key="n.x"), "c": "n: {qa-m: 3}\n", "t": TEMPLATE},
                     "a.yaml: study s: counts.key=n.x: n.x is not in c.yaml"),
    "template-fill": ({"a": TEMPLATED.format(tfile="yaml", counts="c.yaml", key="n"), "c": "n: {qa-m: 3}\n",
                       "t": TEMPLATE.replace("'{seed}'", "'{other}'")},
                      r"a.yaml: study s: cell qa-m: override \{other\}: no fill named other"),
}


@pytest.mark.parametrize("case", list(BAD_SCALES))
def test_bad_derived_scales_are_one_line(tmp_path, case):
    files, message = BAD_SCALES[case]
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    with pytest.raises(ScaleError, match=message):
        load_scale("a", tmp_path)


def test_a_cell_is_typed_and_read_as_kvcert_run_reads_it():
    paper = load_scale("paper", SCALES)
    cell = studies(paper)["paper"]["cells"]["qwen7b-ruler-streaming"]
    values = parse_overrides(cell_overrides(paper, cell))
    # paper.yaml: the grid's budgets and the matrix's setting, typed by Hydra's override grammar
    assert values["budgets"] == [0.1, 0.25, 0.5, 0.75] and values["setting"] == "streaming"
    assert isinstance(values["n_items"], int) and values["data"] == "ruler"
    cfg = cell_config(paper, cell, ["out_dir=x"])
    assert (cfg.n_items, list(cfg.budgets), cfg.setting) == (values["n_items"], values["budgets"], "streaming")
    assert cfg.data.name == "ruler" and cfg.model.name == values["model.name"]


BAD_CELLS = {  # cell spec -> the message
    "typo": ({"model": "m", "overrides": ["budget=[0.5]"]}, "scale=x: cell c: override budget=...: budget is not a kvcert-run key"),
    "nested-typo": ({"model": "m", "overrides": ["design_options.pimin=0.1"]}, "design_options.pimin is not a kvcert-run key"),
    "shards": ({"model": "m", "shards": 0, "overrides": []}, r"scale=x: cell c: shards=0: expected an integer >= 1"),
    "syntax": ({"model": "m", "overrides": ["budgets=[0.5"]}, "scale=x: cell c: "),
    "model": ({"model": "n", "overrides": []}, r"scale=x: cell c: model 'n' is not in models \(m\)"),
    "field": ({"model": "m", "overides": []}, "scale=x: cell c: overides: unknown field"),
}


@pytest.mark.parametrize("case", list(BAD_CELLS))
def test_bad_cells_are_one_line(case):
    spec, message = BAD_CELLS[case]
    with pytest.raises(ScaleError, match=message):
        expand_cells({"name": "x", "models": {"m": ["model=hf"]}, "cells": {"c": spec}})


def _matrix_scale(variants):
    return {"name": "x", "models": {"m": ["model=hf"]}, "grid": ["designs=[topk,poisson]", "budgets=[0.25]"],
            "matrix": {"models": ["m"], "data": {"d": ["data=ruler"]}, "settings": ["question_aware", "streaming"],
                       "shards": 2, "variants": variants}}


def test_a_matrix_variant_adds_a_cell_per_named_setting_after_the_grid():
    """Our own expansion logic on a made-up scale: a variant's overrides follow the base cell's, so they win."""
    cells = expand_cells(_matrix_scale({"defended": {"settings": ["question_aware"],
                                                     "overrides": ["designs=[poisson]", "design_options.tail_mix=0.5"]}}))
    assert list(cells) == ["m-d-question_aware", "m-d-question_aware-defended", "m-d-streaming"]
    base, defended = cells["m-d-question_aware"], cells["m-d-question_aware-defended"]
    assert defended["overrides"] == base["overrides"] + ["designs=[poisson]", "design_options.tail_mix=0.5"]
    assert defended["shards"] == base["shards"] == 2
    values = parse_overrides(defended["overrides"])
    assert values["designs"] == ["poisson"] and values["design_options.tail_mix"] == 0.5


@pytest.mark.parametrize("variants, message", [
    ({"v": {"settings": ["offline"], "overrides": []}}, r"matrix.variants.v: settings=\['offline'\]: expected a non-empty subset"),
    ({"v": {"settings": ["streaming"]}}, "matrix.variants.v: expected a mapping of settings and overrides"),
    ({"v": {"settings": ["streaming"], "overrides": ["design_options.tailmix=1"]}}, "design_options.tailmix is not a kvcert-run key"),
    (["v"], "matrix.variants: expected a mapping"),
])
def test_bad_matrix_variants_are_one_line(variants, message):
    with pytest.raises(ScaleError, match=message):
        expand_cells(_matrix_scale(variants))


def test_longbench_cells_read_the_fetched_copy_unless_they_have_a_path():
    paper, rehearse = load_scale("paper", SCALES), load_scale("rehearse", SCALES)
    paper_cells = studies(paper)["paper"]["cells"]
    assert longbench_subsets(paper, paper_cells) == yaml.safe_load(
        (ROOT / "src" / "kvcert" / "conf" / "data" / "longbench.yaml").read_text())["subsets"]
    assert needs_longbench_copy(paper, paper_cells["qwen7b-longbench6k-streaming"])
    assert not needs_longbench_copy(paper, paper_cells["qwen7b-ruler-streaming"])
    assert longbench_subsets(rehearse, expand_cells(rehearse)) == []


# The DAG a fresh output folder schedules (no job forced) against kvcert-plan's forced DAG: the smoke and default
# scales in make test; the larger ones, a paper-scale dry run each, in make test-full (test_workflow.py's
# test_dry_run_is_clean checks every scale's forced DAG against its expansion in make test).
@pytest.mark.parametrize("scale", ["smoke", "default", *(pytest.param(name, marks=pytest.mark.slow) for name in
                                                        ("paper", "rehearse", "sensitivity", "certified-budgets"))])
def test_the_dag_runs_the_jobs_the_expansion_lists(scale, scale_dag, fresh_dry_run):
    proc = fresh_dry_run(scale)  # shared with test_calibration_workflow's default-scale test (conftest.py)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = (proc.stdout + proc.stderr).split("Job stats:", 1)[-1].split("\ntotal", 1)[0]
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", stats, flags=re.M))
    loaded = load_scale(scale, SCALES)
    assert int(counts["cell"]) == len(shard_list(study_cells(loaded)))
    computed = [name for name, st in studies(loaded).items() if not st["archived"]]
    assert int(counts.get("claim", 0)) == 7 * len(computed)
    # kvcert-plan reads its job count from the DAG, every job forced (the fetch rules and verify_preregistration
    # run only when their outputs are missing, so this dry run may not list them): kvcert.plan.plan_jobs's dry run,
    # built once per scale and session (conftest.py's scale_dag).
    planned = scale_dag(scale)
    skipped = {"fetch_model", "fetch_longbench", "verify_preregistration"}
    assert {k: v for k, v in planned.items() if k not in skipped} == {
        k: int(v) for k, v in counts.items() if k not in skipped | {"total"}}

"""Claims over cells of several models: the pooled result plus the same claim on each model's cells alone,
and the per-model table; cells whose answers all stop at once still have a steps table to pool."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvcert.analysis import aggregate, cli, synthetic
from kvcert.data.longbench import write_copy
from helpers.prereg import locked_copy

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = locked_copy(tmp_path_factory.mktemp("bymodel"))
    cells = {}
    for i, model in enumerate(["model-a", "model-b"]):
        cells[model] = [tmp / "cells" / f"{model}-{s}" for s in ("qa", "st")]
        synthetic.write_cell(cells[model][0], synthetic.SynthSpec(n_items=30, settings=("question_aware",), seed=i,
                                                                  model=model))
        synthetic.write_cell(cells[model][1], synthetic.SynthSpec(n_items=30, settings=("streaming",), seed=10 + i,
                                                                  model=model))
    return tmp, cells


def _run(work, claim, dirs, name=None):
    tmp, _ = work
    out = tmp / "claims" / f"{name or claim}.json"
    return cli.run({"claim": claim, "cells": [str(d) for d in dirs], "out": str(out),
                    "figure_dir": str(tmp / "figs"), "prereg_root": str(tmp), "n_boot": 100})


@pytest.mark.parametrize("claim", ["c1", "c3", "c7"])
def test_pooled_claims_report_each_model(work, claim):
    _, cells = work
    result = _run(work, claim, cells["model-a"] + cells["model-b"])
    by_model = result.details["by_model"]
    assert set(by_model) == {"model-a", "model-b"}
    for model, entry in by_model.items():
        alone = _run(work, claim, cells[model], name=f"{claim}-{model}")  # that model's cells only
        assert "by_model" not in alone.details
        assert entry["estimate"] == pytest.approx(alone.estimate, nan_ok=True)
        assert entry["verdict"] == alone.verdict and entry["n"] == alone.n
    assert result.n == sum(e["n"] for e in by_model.values())  # pooled over both models' items
    saved = json.loads((work[0] / "claims" / f"{claim}.json").read_text())
    assert set(saved["details"]["by_model"]) == {"model-a", "model-b"}


def test_a_model_without_the_population_gets_its_error(work):
    _, cells = work
    # model-b contributes only question-aware cells: C7 (streaming) cannot run on it alone
    result = _run(work, "c7", cells["model-a"] + cells["model-b"][:1])
    # model-a's entry is its claim on its own cells, unchanged by model-b's failure.
    entry, alone = result.details["by_model"]["model-a"], _run(work, "c7", cells["model-a"], name="c7-model-a-alone")
    assert (entry["verdict"], entry["n"]) == (alone.verdict, alone.n) and alone.n > 0
    assert entry["estimate"] == pytest.approx(alone.estimate, nan_ok=True)
    assert set(result.details["by_model"]["model-b"]) == {"error"}
    error = result.details["by_model"]["model-b"]["error"]
    assert "streaming" in error and "\n" not in error


def test_aggregate_writes_the_per_model_table(work, tmp_path):
    tmp, cells = work
    paths = []
    for claim in ("c1", "c3"):
        _run(work, claim, cells["model-a"] + cells["model-b"])
        paths.append(tmp / "claims" / f"{claim}.json")
    aggregate.aggregate(paths, tmp_path)
    table = pd.read_csv(tmp_path / "claims_by_model.csv")
    assert list(table.columns) == aggregate.BY_MODEL_COLUMNS
    assert sorted(zip(table["claim"], table["model"])) == [
        ("c1", "model-a"), ("c1", "model-b"), ("c3", "model-a"), ("c3", "model-b")]
    single = json.loads(paths[0].read_text())
    single["details"].pop("by_model")
    (tmp_path / "one.json").write_text(json.dumps(single))
    aggregate.aggregate([tmp_path / "one.json"], tmp_path / "one")
    assert len(pd.read_csv(tmp_path / "one" / "claims_by_model.csv")) == 0  # header only


def test_an_empty_steps_table_pools_with_others(tmp_path):
    """A cell whose answers all stop at their first token writes a steps table with no rows but every
    column and the runner's dtypes, so that claims can still load it beside the other cells."""
    from kvcert.analysis.data import REQUIRED, load_cells
    from kvcert.generation import STEP_COLUMNS
    from kvcert.runner.tables import empty_step_table, tag_steps

    keys = {"item_id": "i", "policy": "snapkv", "design": "poisson", "budget": 0.25, "seed": 0,
            "setting": "streaming"}
    rows = tag_steps(pd.DataFrame({c: [0.0, 1.0] for c in STEP_COLUMNS}), keys)
    for name, frame in (("full", rows), ("empty", empty_step_table())):
        (tmp_path / name).mkdir()
        frame.to_parquet(tmp_path / name / "steps.parquet", index=False)
    empty = pd.read_parquet(tmp_path / "empty" / "steps.parquet")
    assert len(empty) == 0 and list(empty.columns) == list(rows.columns)
    assert set(REQUIRED["steps"]) <= set(empty.columns)
    assert empty.dtypes.to_dict() == rows.dtypes.to_dict()
    pooled = load_cells([tmp_path / "full", tmp_path / "empty"], "steps")
    assert len(pooled) == 2 and pooled.dtypes.to_dict() == rows.dtypes.to_dict()


def test_longbench_copy_is_written_whole(tmp_path):
    record = {"input": "q", "context": "c", "answers": ["a"], "length": 1, "dataset": "qasper", "language": "en",
              "all_classes": None, "_id": "x", "extra": "dropped"}
    out = write_copy({"qasper": [record]}, tmp_path / "lb")
    assert [p.name for p in out.iterdir()] == ["qasper.jsonl"]
    assert "extra" not in json.loads((out / "qasper.jsonl").read_text())
    with pytest.raises(FileExistsError):
        write_copy({"qasper": [record]}, tmp_path / "lb")
    with pytest.raises(KeyError):
        write_copy({"hotpotqa": [{"input": "q"}]}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))

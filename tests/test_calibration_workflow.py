"""The per-layer calibration table and figure: the rule ``calibration_by_layer`` is in every scale's DAG, and its
script turns real cells (a tiny GGUF model, both settings, calibrated and not) into the table the README
describes, byte for byte the same when run twice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvcert.runner import cli
from kvcert.scales import current_study, scales_folder

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "workflow" / "scripts" / "calibration_by_layer.py"
BASE = ["progress=false", "threads=1", "data=ruler", "data.context_tokens=200", "+data.max_new_tokens=3", "n_items=3",
        "seeds=[0]"]


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    import os

    from helpers.tiny_gguf import shared_kvcert_cache, shared_tiny_gguf

    os.environ["KVCERT_CACHE"] = str(shared_kvcert_cache(tmp_path_factory))
    tiny = shared_tiny_gguf(tmp_path_factory, "qwen2")
    root = tmp_path_factory.mktemp("cells")
    model = ["model=gguf", f"model.path={tiny.path}"]
    qa, streaming = root / "qa", root / "streaming"
    assert cli.main([*BASE, *model, "policies=[snapkv,uniform]", "designs=[topk,poisson]", "budgets=[0.25,0.5]",
                     "setting=question_aware", f"out_dir={qa}"]) == 0
    assert cli.main([*BASE, *model, "policies=[snapkv]", "designs=[poisson]", "budgets=[0.5]", "setting=streaming",
                     "calibration=design", f"out_dir={streaming}"]) == 0
    return [qa, streaming]


def _run(cells, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--cells", *map(str, cells), "--table", str(out / "by_layer.csv"),
                           "--figure", str(out / "calibration_by_layer.png")], capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # make test-full: two more runs of the rule's script over the same cells
def test_table_and_figure_from_real_cells_are_reproducible(cells, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        proc = _run(cells, out)
        assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("by_layer.csv", "calibration_by_layer.png", "calibration_by_layer.pdf"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    table = pd.read_csv(first / "by_layer.csv")
    steps = pd.concat([pd.read_parquet(c / "steps.parquet") for c in cells], ignore_index=True)
    poisson = steps[steps["design"] == "poisson"]
    expected = poisson.groupby(["setting", "policy", "design", "budget", "layer"]).size()
    assert len(table) == len(expected)  # deterministic rows have no certificate, hence no row
    assert set(table["model"]) == {"tiny-qwen2"}
    for row in table.itertuples():
        sub = poisson[(poisson["setting"] == row.setting) & (poisson["policy"] == row.policy)
                      & np.isclose(poisson["budget"], row.budget) & (poisson["layer"] == row.layer)]
        assert row.n_rows == len(sub) and row.n_items == 3
        assert row.coverage == pytest.approx((sub["true_err"] <= sub["cert"]).mean(), abs=1e-6)  # CSV keeps 6 digits
        assert row.coverage_low <= row.coverage <= row.coverage_high
    # the streaming cell ran with calibration=design: its rows carry the calibrated columns
    calibrated = table[table["setting"] == "streaming"]
    assert calibrated["coverage_calibrated"].notna().all()
    assert (calibrated["median_rel_width_calibrated"] >= calibrated["median_rel_width"] - 1e-9).all()
    assert table.loc[table["setting"] == "question_aware", "coverage_calibrated"].isna().all()


def test_a_cell_without_tables_is_one_line(cells, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = _run([cells[0], tmp_path / "empty"], tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"calibration_by_layer: error: {tmp_path / 'empty' / 'steps.parquet'}: missing"
    assert not (tmp_path / "out").exists()


def test_the_default_scale_schedules_the_rule(fresh_dry_run):
    proc = fresh_dry_run("default")  # the default scale's dry run, shared with test_scales.py (conftest.py)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    assert "rule calibration_by_layer" in text or "calibration_by_layer" in text
    # one table per study that runs cells: the current study (read from the default scale), none for the records
    from kvcert.scales import load_scale, studies

    scale = studies(load_scale("default", scales_folder(ROOT)))
    assert [s for s, spec in scale.items() if not spec["archived"]] == [current_study(scales_folder(ROOT))]
    for study, spec in scale.items():
        table = f"results/dryrun-default/{study}/calibration/by_layer.csv"
        assert (table in text) == (not spec["archived"]), table

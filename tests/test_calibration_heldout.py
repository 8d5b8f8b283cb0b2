"""The calibrated certificate's check, as a user would run it, on the bundled model and a workload the
method's defaults were not chosen on (they were chosen on SmolLM2 with one and two pass keys in a noise
haystack; here: multi-value and multi-query needles in a prose haystack, ~600 tokens):

1. ``kvcert-calibrate`` on half of the prompts (shard 0 of 2 by task: 10 of each task);
2. ``kvcert-run ... calibration=<file>`` on the other half (shard 1 of 2 by task: 20 prompts, never calibrated on);
3. at budgets 0.25 and 0.5, the worst layer's ``coverage_calibrated`` (the default certificate: level 0.99,
   never below ε̂) is at least 0.90; the median width bar (at most 1.5 times the median ``cert``) is checked on
   the same factors served without the floor (``never_below_paper=false``), the option for a narrower
   certificate. With the floor the width is measured and reported, not asserted: on SmolLM2, whose ε̂ is loose in
   many layers, never narrowing it costs 1.64-1.67x (README, *Calibrated certificates*), above the bar, while the
   floor is what held every layer on the held-out model (docs/CALIBRATION-LEVEL.md, third confirmation).

Why the coverage bar is 0.90 although the file aims at 0.99 per layer (the default level, 1 − δ/5): each layer's
held-out coverage is estimated from 20 prompts whose rows move together, and the worst of 30 layers is taken; the
study (README, *Calibrated certificates*) saw per-layer held-out coverage at least 0.968 at this level on 20
calibration prompts, so 0.90 leaves room for the sampling error of one run without hiding a method that misses
its level.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from kvcert.calibration import Calibration, calibrated_certificate
from kvcert.runner import calibrate, cli

pytestmark = [pytest.mark.smollm2, pytest.mark.slow, pytest.mark.heldout]

WORKLOAD = ["data=ruler", "data.tasks=[niah_multivalue_2,niah_multiquery_2]", "data.haystack=prose",
            "data.context_tokens=600", "data.seed=3", "n_items=40", "n_shards=2", "shard_by=task", "policies=[snapkv]",
            "designs=[poisson]", "budgets=[0.25,0.5]", "seeds=[0]", "setting=question_aware", "threads=2",
            "progress=false"]  # 2 threads: the two stages run alone, one after the other (CI's 2 cores; 1.4x faster)
COVERAGE_BAR = 0.90  # the worst layer's held-out coverage at each budget, with the default certificate
WIDTH_BAR = 1.5  # the median certificate over the median cert, for the factors served without the floor


def test_calibrated_certificate_holds_in_every_layer_on_held_out_prompts(tmp_path, capsys):
    file = tmp_path / "smollm2.json"
    assert calibrate.main([*WORKLOAD, "shard=0", f"out={file}"]) == 0, capsys.readouterr().err[-3000:]
    run = tmp_path / "held-out"
    assert cli.main([*WORKLOAD, "shard=1", f"calibration={file}", f"out_dir={run}"]) == 0, capsys.readouterr().err[-3000:]
    steps = pd.read_parquet(run / "steps.parquet")
    steps = steps[steps["design"] == "poisson"]
    assert steps["item_id"].nunique() == 20
    assert pd.read_parquet(run / "items.parquet").groupby("task")["item_id"].nunique().to_dict() == {
        "niah_multivalue_2": 10, "niah_multiquery_2": 10}  # both halves hold both tasks
    calibration = Calibration.load(file)
    assert calibration.never_below_paper  # the default
    without_floor = dataclasses.replace(calibration, never_below_paper=False)
    for budget in (0.25, 0.5):
        rows = steps[np.isclose(steps["budget"], budget)]
        per_layer = rows.groupby("layer")["coverage_calibrated"].mean()
        assert len(per_layer) == 30
        assert per_layer.min() >= COVERAGE_BAR, per_layer.sort_values().head(5).to_dict()
        assert (rows["cert_calibrated"] >= rows["cert"]).all()
        plain = calibrated_certificate(without_floor, rows, setting="question_aware", policy="snapkv", design="poisson",
                                       budget=budget)
        ratio = np.median(plain) / rows["cert"].median()
        assert ratio <= WIDTH_BAR, ratio
        print(f"budget {budget}: worst layer {per_layer.min():.3f}, median width x eps-hat "
              f"{rows['cert_calibrated'].median() / rows['cert'].median():.2f} (default), {ratio:.2f} (without the floor)")

"""A held-out check's pre-registered criterion (workflow/scripts/heldout_check.py) on small synthetic summary tables
(no model): each part's verdict against cases worked out by hand below, and the check's errors. Every number here
is test data, never a result."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("heldout_check", ROOT / "workflow" / "scripts" / "heldout_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(model, configuration, accuracy, kept, eps=None, low=None, high=None):
    out = {"model": model, "configuration": configuration, "target_error": eps, "accuracy": accuracy,
           "kept_fraction": kept}
    for e in (0.1, 0.05):
        out[f"coverage_low_{e:g}"] = low if eps == e else 0.5
        out[f"coverage_high_{e:g}"] = high if eps == e else 0.5
    return out


def fixed_rows(model, poisson_accuracy=80.0, topk_accuracy=85.0):
    return [row(model, "full", 85.0, 1.0), row(model, "fixed poisson 0.5", poisson_accuracy, 0.5002),
            row(model, "fixed topk 0.5", topk_accuracy, 0.5)]


@pytest.fixture()
def tables():
    check_summary = pd.DataFrame([
        *fixed_rows("a"), *fixed_rows("b", poisson_accuracy=90.0),
        # a: keeps less at equal accuracy; coverage ends move by 0.01 and 0.02 (exactly the margin): holds
        row("a", "target 0.1", 80.0, 0.45, eps=0.1, low=0.94, high=0.97),
        # a, no cap: keeps more than the fixed budget; coverage within: memory fails only
        row("a", "target 0.1 cap 1", 85.0, 0.60, eps=0.1, low=0.98, high=0.99),
        # b: keeps less but at lower accuracy (85 < 90), and the low end moves by 0.03: both parts fail
        row("b", "target 0.05", 85.0, 0.40, eps=0.05, low=0.90, high=0.93),
    ])
    study = pd.DataFrame([
        row("a", "target 0.1", 82.5, 0.45, eps=0.1, low=0.95, high=0.95),
        row("a", "target 0.1 cap 1", 82.5, 0.60, eps=0.1, low=0.985, high=0.988),
        row("b", "target 0.05", 50.0, 0.40, eps=0.05, low=0.87, high=0.92),
    ])
    return check_summary, study


def test_each_part_of_the_criterion_against_hand_worked_cases(check, tables):
    out = check.heldout_check(*tables, fixed="fixed poisson 0.5", margin=0.02).set_index(["model", "configuration"])
    assert list(out.columns) == check.COLUMNS[2:]
    a, a_uncapped, b = out.loc[("a", "target 0.1")], out.loc[("a", "target 0.1 cap 1")], out.loc[("b", "target 0.05")]
    assert (a.memory_holds, a.coverage_holds, a.holds) == (True, True, True)
    assert a.coverage_gap == pytest.approx(0.02)
    assert (a_uncapped.memory_holds, a_uncapped.coverage_holds, a_uncapped.holds) == (False, True, False)
    assert a_uncapped.coverage_gap == pytest.approx(0.005)
    assert (b.memory_holds, b.coverage_holds, b.holds) == (False, False, False)
    assert b.coverage_gap == pytest.approx(0.03)
    # reported beside the verdict, never part of it
    assert (a.fixed_accuracy, a.full_accuracy, a.other_fixed, a.other_fixed_accuracy) == (80.0, 85.0,
                                                                                         "fixed topk 0.5", "85")
    assert b.fixed_kept_fraction == pytest.approx(0.5002)


def test_a_smaller_margin_turns_the_coverage_verdict(check, tables):
    out = check.heldout_check(*tables, fixed="fixed poisson 0.5", margin=0.015)
    assert out.set_index(["model", "configuration"]).loc[("a", "target 0.1"), "holds"] == False  # noqa: E712


def test_a_configuration_missing_from_the_study_is_named(check, tables):
    summary, study = tables
    with pytest.raises(ValueError, match=r"study.csv: 0 rows of model=a configuration='target 0.1 cap 1'"):
        check.heldout_check(summary, study[study["configuration"] != "target 0.1 cap 1"], fixed="fixed poisson 0.5",
                            margin=0.02, study_source="study.csv")


def test_the_fixed_budget_must_exist_and_the_margin_be_a_share(check, tables):
    with pytest.raises(ValueError, match=r"0 rows of model=a configuration='fixed poisson 0.25'"):
        check.heldout_check(*tables, fixed="fixed poisson 0.25", margin=0.02)
    with pytest.raises(ValueError, match=r"check.margin=2: must lie in \[0, 1\)"):
        check.heldout_check(*tables, fixed="fixed poisson 0.5", margin=2)


def test_main_writes_the_table_and_names_a_missing_study_file(check, tables, tmp_path):
    summary, study = tables
    summary.to_csv(tmp_path / "summary.csv", index=False)
    study.to_csv(tmp_path / "study.csv", index=False)
    check.main(tmp_path / "summary.csv", tmp_path / "study.csv", "fixed poisson 0.5", 0.02, tmp_path / "check.csv")
    written = pd.read_csv(tmp_path / "check.csv")
    assert list(written.columns) == check.COLUMNS and len(written) == 3
    with pytest.raises(SystemExit, match="check.against=.*nowhere.csv: no such file"):
        check.main(tmp_path / "summary.csv", tmp_path / "nowhere.csv", "fixed poisson 0.5", 0.02,
                   tmp_path / "other.csv")
    assert not (tmp_path / "other.csv").exists()

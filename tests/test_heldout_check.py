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


# --- the paired table (workflow/scripts/heldout_paired.py; exploratory, no part of the criterion) -----------------


@pytest.fixture(scope="module")
def paired():
    spec = importlib.util.spec_from_file_location("heldout_paired", ROOT / "workflow" / "scripts" / "heldout_paired.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counted(model, configuration, correct, n=40, eps=None):
    return {"model": model, "configuration": configuration, "target_error": eps, "n_items": n,
            "accuracy": 100 * correct / n}


def test_the_paired_table_bounds_the_exact_mcnemar_p_by_the_items_lost(paired):
    # 39 of 40 right under the fixed budget: a target at 38 lost one item, at 33 six, at 40 none (one gained)
    summary = pd.DataFrame([counted("m", "full", 40), counted("m", "fixed poisson 0.5", 39),
                            counted("m", "target 0.1", 38, eps=0.1), counted("m", "target 0.05", 33, eps=0.05),
                            counted("m", "target 0.1 floor 0.25", 40, eps=0.1)])
    table = paired.paired_table(summary, "fixed poisson 0.5").set_index("configuration")
    assert table["lost"].tolist() == [1, 6, -1] and table["min_discordant"].tolist() == [1, 6, 1]
    # one discordant item: p = 1 whatever the pairing; six all one way: 2 · 0.5^6; a gain of one: 1 again
    assert table["mcnemar_p_min"].tolist() == pytest.approx([1.0, 2 * 0.5 ** 6, 1.0])
    assert (table["correct"] + table["lost"] == table["fixed_correct"]).all()


def test_the_paired_table_refuses_unpaired_or_fractional_items(paired):
    unpaired = pd.DataFrame([counted("m", "fixed poisson 0.5", 39), counted("m", "target 0.1", 19, n=20, eps=0.1)])
    with pytest.raises(ValueError, match=r"'target 0.1' has 20 items, 'fixed poisson 0.5' 40: not paired$"):
        paired.paired_table(unpaired, "fixed poisson 0.5")
    fractional = pd.DataFrame([counted("m", "fixed poisson 0.5", 39), {**counted("m", "target 0.1", 38, eps=0.1),
                                                                          "accuracy": 95.3}])
    with pytest.raises(ValueError, match=r"accuracy 95.3 of 40 items is not a whole number of items$"):
        paired.paired_table(fractional, "fixed poisson 0.5")
    with pytest.raises(ValueError, match=r"0 rows of model=m configuration='fixed topk 0.5'"):
        paired.paired_table(unpaired, "fixed topk 0.5")


@pytest.mark.parametrize("name", ["certified-budgets-heldout-2", "certified-budgets-heldout-3"])
def test_the_committed_paired_tables_are_their_summaries(paired, name, tmp_path):
    """The committed paired.csv of each pre-registered check is recomputed byte for byte from its summary.csv."""
    folder = ROOT / "results" / name / "certified-budgets"
    paired.main(folder / "summary.csv", "fixed poisson 0.5", tmp_path / "paired.csv")
    assert (tmp_path / "paired.csv").read_text() == (folder / "paired.csv").read_text()


def test_the_items_a_noninferiority_check_needs(paired):
    # by hand: z(0.95) = 1.6449, z(0.8) = 0.8416; (2.4865)² · 0.1 / 0.05² = 247.3 -> 248 items
    assert paired.noninferiority_items(0.1, 0.05, 0.05, 0.8) == 248
    # more discordance or a smaller margin needs more items, a looser level fewer
    assert paired.noninferiority_items(0.2, 0.05, 0.05, 0.8) == 495
    assert paired.noninferiority_items(0.1, 0.025, 0.05, 0.8) == 990
    assert paired.noninferiority_items(0.1, 0.05, 0.1, 0.8) < 248
    with pytest.raises(ValueError, match=r"^margin=0: must lie in \(0, 1\)$"):
        paired.noninferiority_items(0.1, 0, 0.05, 0.8)
    with pytest.raises(ValueError, match=r"^power=0.3: must lie in \(0.5, 1\)$"):
        paired.noninferiority_items(0.1, 0.05, 0.05, 0.3)

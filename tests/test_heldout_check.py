"""Held-out checks decided from their locked specs (kvcert.analysis.heldout; workflow/scripts/heldout_check.py):
the committed check.csv of checks 2 and 3 recomputed byte for byte from the committed summaries, check 3's floor
decision, each part of the criterion against cases worked out by hand, the spec's lock and its errors, and the rule
for future checks. Synthetic tables below are test data, never a result."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers.scripts import workflow_script
from kvcert.analysis import heldout
from kvcert.analysis.errors import AnalysisError, PreregistrationError
from kvcert.analysis.prereg_cli import main as prereg_main
from kvcert.analysis.verdicts import NOT_SUPPORTED, SUPPORTED

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["certified-budgets-heldout-2", "certified-budgets-heldout-3"]


@pytest.fixture(scope="module")
def check():
    return workflow_script("heldout_check")


@pytest.fixture(scope="module")
def paired():
    return workflow_script("heldout_paired")


# --- the committed checks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", CHECKS)
def test_the_locked_spec_recomputes_the_committed_check_byte_for_byte(check, scale, tmp_path):
    """The spec transcribed from the scale's comment, decided through verdicts.decide, writes the committed
    check.csv from the committed summary.csv; the scale's own check keys agree with the spec."""
    folder = ROOT / "results" / scale / "certified-budgets"
    from kvcert.scales import load_scale, scales_folder

    scale_check = load_scale(scale, scales_folder(ROOT))["exploratory"]["certified-budgets"]["check"]
    check.main(folder / "summary.csv", scale, ROOT, dict(scale_check), tmp_path / "check.csv",
               tmp_path / "decisions.csv")
    assert (tmp_path / "check.csv").read_text() == (folder / "check.csv").read_text()
    assert (tmp_path / "decisions.csv").read_text() == (folder / "decisions.csv").read_text()


def test_check_3_decides_the_floor_as_measured():
    """The floor holds where all four floored rows hold: on Gemma 3 both do, on SmolLM2 neither (coverage above the
    reference's beyond the two-sided margin at both eps, and one item lost at eps 0.05)."""
    spec = heldout.load_spec(ROOT, "certified-budgets-heldout-3")
    folder = ROOT / "results" / spec.scale / "certified-budgets"
    table = heldout.check_table(pd.read_csv(folder / "summary.csv"), pd.read_csv(ROOT / spec.against), spec)
    floor = heldout.decisions(table, spec).set_index("decision").loc["floor"]
    assert (floor["n_rows"], floor["n_holding"], floor["holds"]) == (4, 2, False)
    rows = table.set_index(["model", "configuration"])
    assert rows.loc[("gemma3", "target 0.1 floor 0.25"), "holds"] and rows.loc[("gemma3", "target 0.05 floor 0.25"),
                                                                                 "holds"]
    smollm2 = rows.loc[("smollm2", "target 0.05 floor 0.25")]
    assert smollm2["coverage_low"] > smollm2["study_coverage_low"] + spec.margin  # higher, outside the margin
    assert smollm2["fixed_accuracy"] - smollm2["accuracy"] == pytest.approx(2.5)  # one item of 40
    # the same rows under the rule for future checks: coverage one-sided, so the higher coverage passes
    assert heldout.future_coverage(smollm2["coverage_low"], smollm2["study_coverage_low"],
                                   spec.future).verdict == SUPPORTED


def test_prereg_verify_checks_every_exploratory_lock(capsys, monkeypatch):
    # A mock, about our own logic: the claims' locks are hashed by the tests of kvcert-prereg (about 11 s); here only
    # that verify also checks every exploratory lock.
    import kvcert.analysis.prereg as prereg

    monkeypatch.setattr(prereg, "verify_lock", lambda root, number: None)
    assert heldout.locked_scales(ROOT) == CHECKS
    assert prereg_main(["--root", str(ROOT), "verify"]) == 0
    out = capsys.readouterr().out
    assert all(f"exploratory {scale} lock OK (4 files" in out for scale in CHECKS)


# --- the spec's lock -------------------------------------------------------------------------------------------------


@pytest.fixture()
def root(tmp_path):
    """A copy of the files a spec's lock freezes, under a throwaway root."""
    for rel in {*heldout.DECIDING_MODULES, *(f for s in CHECKS for f in heldout.locked_files(s)),
                *(heldout.lock_path(s) for s in CHECKS)}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_a_changed_spec_or_deciding_module_is_refused(root):
    scale = CHECKS[1]
    heldout.verify_spec_lock(root, scale)
    spec = root / heldout.spec_path(scale)
    spec.write_text(spec.read_text().replace("margin: 0.02", "margin: 0.05"))
    with pytest.raises(PreregistrationError, match=rf"^{heldout.spec_path(scale)} changed since .*frozen$"):
        heldout.verify_spec_lock(root, scale)
    shutil.copy(ROOT / heldout.spec_path(scale), spec)
    verdicts = root / "src/kvcert/analysis/verdicts.py"
    verdicts.write_text(verdicts.read_text() + "\n")
    with pytest.raises(PreregistrationError, match=r"^src/kvcert/analysis/verdicts.py changed since"):
        heldout.verify_spec_lock(root, scale)


def test_a_spec_is_locked_once_and_decided_only_when_locked(root, check, capsys):
    scale = CHECKS[0]
    (root / heldout.lock_path(scale)).unlink()
    with pytest.raises(PreregistrationError, match=rf"^{heldout.lock_path(scale)} is missing: lock the spec"):
        heldout.verify_spec_lock(root, scale)
    assert prereg_main(["--root", str(root), "lock", "--exploratory", scale]) == 0
    heldout.verify_spec_lock(root, scale)
    assert prereg_main(["--root", str(root), "lock", "--exploratory", scale]) == 1
    assert "already exists: the spec is frozen" in capsys.readouterr().err


def test_spec_errors_name_the_file_and_key(root, check, tmp_path):
    scale = CHECKS[1]
    spec = root / heldout.spec_path(scale)
    spec.write_text(spec.read_text().replace("margin: 0.02\n", "margin: 2\n"))
    with pytest.raises(AnalysisError, match=rf"^{heldout.spec_path(scale)}: margin=2: expected a number in \[0, 1\)$"):
        heldout.load_spec(root, scale)
    with pytest.raises(AnalysisError, match=r"exploratory/nowhere.yaml: missing"):
        heldout.load_spec(root, "nowhere")
    # the scale's check keys must name what the locked spec names
    shutil.copy(ROOT / heldout.spec_path(scale), spec)
    (root / "results").mkdir()
    with pytest.raises(SystemExit, match=r"check.fixed='fixed topk 0.5' differs from the locked .*'fixed poisson 0.5'"):
        check.main(ROOT / "results" / scale / "certified-budgets" / "summary.csv", scale, root,
                   {"fixed": "fixed topk 0.5"}, tmp_path / "check.csv", tmp_path / "decisions.csv")
    assert not (tmp_path / "check.csv").exists()


# --- the criterion on hand-worked cases ------------------------------------------------------------------------------


def row(model, configuration, accuracy, kept, eps=None, low=None, high=None, design="poisson"):
    out = {"model": model, "configuration": configuration, "design": design, "target_error": eps,
           "accuracy": accuracy, "kept_fraction": kept}
    for e in (0.1, 0.05):
        out[f"coverage_low_{e:g}"] = low if eps == e else 0.5
        out[f"coverage_high_{e:g}"] = high if eps == e else 0.5
    return out


def fixed_rows(model, poisson_accuracy=80.0, topk_accuracy=85.0):
    return [row(model, "full", 85.0, 1.0, design="full"), row(model, "fixed poisson 0.5", poisson_accuracy, 0.5002),
            row(model, "fixed topk 0.5", topk_accuracy, 0.5, design="topk")]


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
        # a clt row (target error, design clt) is no target row: the check ignores it
        row("a", "clt 0.1", 0.0, 1.0, eps=0.1, low=0.0, high=0.0, design="clt"),
    ])
    study = pd.DataFrame([
        row("a", "target 0.1", 82.5, 0.45, eps=0.1, low=0.95, high=0.95),
        row("a", "target 0.1 cap 1", 82.5, 0.60, eps=0.1, low=0.985, high=0.988),
        row("b", "target 0.05", 50.0, 0.40, eps=0.05, low=0.87, high=0.92),
    ])
    return check_summary, study


@pytest.fixture(scope="module")
def spec():
    return heldout.load_spec(ROOT, CHECKS[0])


def test_each_part_of_the_criterion_against_hand_worked_cases(tables, spec):
    out = heldout.check_table(*tables, spec).set_index(["model", "configuration"])
    assert list(out.columns) == heldout.CHECK_COLUMNS[2:] and len(out) == 3
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


def test_each_component_is_the_claims_rule_on_a_point(tables, spec):
    summary, study = tables
    t = summary.set_index("configuration").loc["target 0.1"]
    fixed = summary.set_index(["model", "configuration"]).loc[("a", "fixed poisson 0.5")]
    kept, accuracy, coverage = heldout.components(t, fixed, study.iloc[0], spec)
    assert (kept.name, kept.direction, kept.threshold, kept.verdict) == ("kept_less", "greater", 0.0, SUPPORTED)
    assert kept.ci_low == kept.ci_high == pytest.approx(0.0502)
    assert (accuracy.estimate, accuracy.verdict) == (0.0, SUPPORTED)  # equal accuracy: "at least" holds
    assert (coverage.direction, coverage.verdict) == ("less", SUPPORTED)
    worse = heldout.components(t.copy().replace({80.0: 77.5}), fixed, study.iloc[0], spec)[1]
    assert worse.verdict == NOT_SUPPORTED


def test_a_smaller_margin_turns_the_coverage_verdict(tables, spec):
    out = heldout.check_table(*tables, replace(spec, margin=0.015))
    assert not out.set_index(["model", "configuration"]).loc[("a", "target 0.1"), "holds"]


def test_missing_rows_and_decisions_are_named(tables, spec):
    summary, study = tables
    with pytest.raises(AnalysisError, match=r"study.csv: 0 rows of model=a configuration='target 0.1 cap 1'"):
        heldout.check_table(summary, study[study["configuration"] != "target 0.1 cap 1"], spec, "study.csv")
    with pytest.raises(AnalysisError, match=r"0 rows of model=a configuration='fixed poisson 0.25'"):
        heldout.check_table(*tables, replace(spec, fixed="fixed poisson 0.25"))
    table = heldout.check_table(*tables, spec)
    decided = heldout.decisions(table, replace(spec, decisions=(("both", ("target 0.1", "target 0.05")),)))
    assert decided.iloc[0][["n_rows", "n_holding", "holds"]].tolist() == [2, 1, False]
    with pytest.raises(AnalysisError, match=r"decisions.x names 'target 9', not in check.csv"):
        heldout.decisions(table, replace(spec, decisions=(("x", ("target 9",)),)))


# --- the rule for future checks --------------------------------------------------------------------------------------


def test_the_items_a_noninferiority_check_needs_and_the_specs_count(spec):
    # by hand: z(0.95) = 1.6449, z(0.8) = 0.8416; (2.4865)² · 0.1 / 0.05² = 247.3 -> 248 items
    assert heldout.noninferiority_items(0.1, 0.05, 0.05, 0.8) == 248
    assert heldout.noninferiority_items(0.2, 0.05, 0.05, 0.8) == 495
    assert heldout.noninferiority_items(0.1, 0.025, 0.05, 0.8) == 990
    assert heldout.noninferiority_items(0.1, 0.05, 0.1, 0.8) < 248
    f = spec.future
    assert f["n_items"] == heldout.noninferiority_items(f["discordance"], f["accuracy_margin"] / 100, f["alpha"],
                                                        f["power"])
    with pytest.raises(ValueError, match=r"^margin=0: must lie in \(0, 1\)$"):
        heldout.noninferiority_items(0.1, 0, 0.05, 0.8)
    with pytest.raises(ValueError, match=r"^power=0.3: must lie in \(0.5, 1\)$"):
        heldout.noninferiority_items(0.1, 0.05, 0.05, 0.3)


def test_future_accuracy_is_an_exact_paired_noninferiority_rule(spec):
    n = spec.future["n_items"]
    fixed = np.ones(n, dtype=bool)
    # one item lost, none gained: b = 1 of m = 1; exact 95% upper bound of b/m is 1, so the loss bound is 100/n
    target = fixed.copy()
    target[0] = False
    one = heldout.future_accuracy(target, fixed, spec.future)
    assert one.estimate == pytest.approx(100 / n) and one.ci_high == pytest.approx(100 / n)
    assert one.verdict == SUPPORTED  # 0.4 points < 5
    # twenty lost, none gained: 8.06 points lost, its bound above the margin
    target[:20] = False
    assert heldout.future_accuracy(target, fixed, spec.future).verdict == NOT_SUPPORTED
    # twenty discordant each way: estimate 0, bound (2 p_u - 1) * 40 / n * 100 with p_u the exact bound of 10/20
    balanced = fixed.copy()
    balanced[:10] = False
    other = np.ones(n, dtype=bool)
    other[10:20] = False
    from scipy.stats import beta

    p_u = beta.ppf(0.95, 11, 10)
    component = heldout.future_accuracy(balanced, other, spec.future)
    assert component.estimate == 0 and component.ci_high == pytest.approx((2 * p_u - 1) * 20 / n * 100)
    with pytest.raises(AnalysisError, match=rf"40 items, fewer than the spec's future.n_items={n}"):
        heldout.future_accuracy(fixed[:40], fixed[:40], spec.future)


# --- the paired table (workflow/scripts/heldout_paired.py; exploratory, no part of the criterion) -----------------


def counted(model, configuration, correct, n=40, eps=None, design="poisson"):
    return {"model": model, "configuration": configuration, "design": design, "target_error": eps, "n_items": n,
            "accuracy": 100 * correct / n}


def test_the_paired_table_bounds_the_exact_mcnemar_p_by_the_items_lost(paired):
    # 39 of 40 right under the fixed budget: a target at 38 lost one item, at 33 six, at 40 none (one gained)
    summary = pd.DataFrame([counted("m", "full", 40, design="full"), counted("m", "fixed poisson 0.5", 39),
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


@pytest.mark.parametrize("name", CHECKS)
def test_the_committed_paired_tables_are_their_summaries(paired, name, tmp_path):
    """The committed paired.csv of each pre-registered check is recomputed byte for byte from its summary.csv."""
    folder = ROOT / "results" / name / "certified-budgets"
    paired.main(folder / "summary.csv", "fixed poisson 0.5", tmp_path / "paired.csv")
    assert (tmp_path / "paired.csv").read_text() == (folder / "paired.csv").read_text()

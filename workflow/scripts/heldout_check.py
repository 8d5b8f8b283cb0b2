"""A certified-budgets held-out check's pre-registered criterion (rule ``certified_budgets_check``): the check's
``summary.csv`` against the study's (the scale's ``check.against``), written before the check's cells ran
(workflow/scales/certified-budgets-heldout-2.yaml; certified-budgets-heldout-3.yaml applies it to the floored
targets, against certified-budgets-floor's summary). Exploratory: no claim reads it.

One row of ``check.csv`` per model and target configuration of the check (``target <eps>`` at the study's cap,
``target <eps> cap <budget>`` at another), beside the study's row of the same model and configuration:

* memory: the kept fraction is below the fixed budget's (the scale's ``check.fixed``, e.g. ``fixed poisson 0.5``)
  and the accuracy is at least that budget's;
* coverage: both ends of the bracket of the coverage of eps (``coverage_low``: certainly within eps,
  ``coverage_high``: possibly within; workflow/scripts/certified_budgets.py) lie within ``check.margin`` of the
  study's;
* holds: memory and coverage.

Beside them, with no verdict: the accuracy of the full cache and of the other fixed budgets at the same fraction.
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import pandas as pd

from kvcert.atomic import write_text_atomic

COLUMNS = ["model", "configuration", "target_error", "kept_fraction", "accuracy", "fixed", "fixed_kept_fraction",
           "fixed_accuracy", "memory_holds", "coverage_low", "coverage_high", "study_coverage_low",
           "study_coverage_high", "coverage_gap", "coverage_holds", "holds", "full_accuracy", "other_fixed",
           "other_fixed_accuracy"]
# Rounding of the tables (6 decimals) must not turn a gap of exactly the margin into a miss.
TOLERANCE = 1e-9


def _row(table: pd.DataFrame, model: str, configuration: str, source: str) -> pd.Series:
    found = table[(table["model"] == model) & (table["configuration"] == configuration)]
    if len(found) != 1:
        raise ValueError(f"{source}: {len(found)} rows of model={model} configuration={configuration!r}; "
                         "the check needs exactly one")
    return found.iloc[0]


def heldout_check(summary: pd.DataFrame, study: pd.DataFrame, fixed: str, margin: float,
                  study_source: str = "the study's summary.csv") -> pd.DataFrame:
    """check.csv's rows (COLUMNS) for every target configuration of ``summary`` (the check's summary.csv).

    summary, study: summary.csv tables (workflow/scripts/certified_budgets.py); fixed: the configuration the
    memory part compares with; margin: the coverage part's largest difference of either bracket end.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"check.margin={margin!r}: must lie in [0, 1)")
    rows = []
    targets = summary[summary["configuration"].str.startswith("target ")]
    if targets.empty:
        raise ValueError("the check's summary.csv holds no target configuration")
    fixed_fraction = fixed.rsplit(" ", 1)[-1]
    for _, t in targets.iterrows():
        model, eps = t["model"], float(t["target_error"])
        base = _row(summary, model, fixed, "the check's summary.csv")
        full = _row(summary, model, "full", "the check's summary.csv")
        reference = _row(study, model, t["configuration"], study_source)
        low, high = f"coverage_low_{eps:g}", f"coverage_high_{eps:g}"
        gap = max(abs(t[low] - reference[low]), abs(t[high] - reference[high]))
        memory = bool(t["kept_fraction"] < base["kept_fraction"] and t["accuracy"] >= base["accuracy"])
        coverage = bool(gap <= margin + TOLERANCE)
        others = summary[(summary["model"] == model) & summary["configuration"].str.startswith("fixed ")
                         & summary["configuration"].str.endswith(f" {fixed_fraction}")
                         & (summary["configuration"] != fixed)]
        rows.append({"model": model, "configuration": t["configuration"], "target_error": eps,
                     "kept_fraction": t["kept_fraction"], "accuracy": t["accuracy"], "fixed": fixed,
                     "fixed_kept_fraction": base["kept_fraction"], "fixed_accuracy": base["accuracy"],
                     "memory_holds": memory, "coverage_low": t[low], "coverage_high": t[high],
                     "study_coverage_low": reference[low], "study_coverage_high": reference[high],
                     "coverage_gap": gap, "coverage_holds": coverage, "holds": memory and coverage,
                     "full_accuracy": full["accuracy"],
                     "other_fixed": "; ".join(others["configuration"]),
                     "other_fixed_accuracy": "; ".join(f"{a:g}" for a in others["accuracy"])})
    return pd.DataFrame(rows, columns=COLUMNS)


def main(summary: Path, study: Path, fixed: str, margin: float, out: Path) -> None:
    if not Path(study).is_file():
        raise SystemExit(f"check.against={study}: no such file (the study's summary.csv, committed with the study)")
    table = heldout_check(pd.read_csv(summary), pd.read_csv(study), fixed, float(margin), str(study))
    write_text_atomic(table.round(6).to_csv(index=False), Path(out))


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(Path(sm.input.summary), Path(sm.input.study), str(sm.params.check["fixed"]), sm.params.check["margin"],
         Path(sm.output[0]))

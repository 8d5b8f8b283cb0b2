"""What a paired test of accuracy can say from a held-out check's committed tables (rule ``certified_budgets_paired``,
``paired.csv``). EXPLORATORY: added after held-out check 3 was read; no part of any check's criterion, no claim
reads it.

A check's target and its fixed budget (the scale's ``check.fixed``) decode the same items, so their accuracies are
paired, and an exact McNemar test reads only the discordant items: b answered right by the fixed budget and wrong by
the target, c the reverse, p = the two-sided exact binomial p-value of c in b + c trials at one half
(scipy.stats.binomtest). The item tables that name the discordant items are not committed; the summary's
accuracies fix only b − c, the items the target lost (``lost``). So per model and target configuration:

* ``min_discordant``: the fewest discordant items the accuracies allow, |b − c|;
* ``mcnemar_p_min``: the smallest exact McNemar p-value any pairing of the items allows (the pairing with
  c = 0 and b = lost, or the reverse); every pairing's p-value lies in [mcnemar_p_min, 1]. A loss of one item
  gives 1 whatever the pairing: no paired test can tell it from chance.
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import pandas as pd
from scipy.stats import binomtest

from kvcert.analysis.heldout import target_rows
from kvcert.atomic import write_text_atomic

COLUMNS = ["model", "configuration", "target_error", "fixed", "n_items", "correct", "fixed_correct", "lost",
           "min_discordant", "mcnemar_p_min"]


def _correct(row: pd.Series, source: str) -> int:
    """Items answered right: accuracy (%) × n_items, an integer up to the tables' rounding."""
    value = float(row["accuracy"]) * int(row["n_items"]) / 100
    if abs(value - round(value)) > 1e-3:
        raise ValueError(f"{source}: model={row['model']} configuration={row['configuration']!r}: accuracy "
                         f"{row['accuracy']} of {row['n_items']} items is not a whole number of items")
    return int(round(value))


def paired_table(summary: pd.DataFrame, fixed: str, source: str = "summary.csv") -> pd.DataFrame:
    """paired.csv's rows (COLUMNS): every target configuration of ``summary`` (a check's summary.csv) against the
    configuration ``fixed`` of the same model, which must have decoded as many items."""
    rows = []
    for _, t in target_rows(summary).iterrows():
        found = summary[(summary["model"] == t["model"]) & (summary["configuration"] == fixed)]
        if len(found) != 1:
            raise ValueError(f"{source}: {len(found)} rows of model={t['model']} configuration={fixed!r}; the "
                             "paired table needs exactly one")
        base = found.iloc[0]
        if int(base["n_items"]) != int(t["n_items"]):
            raise ValueError(f"{source}: model={t['model']}: {t['configuration']!r} has {t['n_items']} items, "
                             f"{fixed!r} {base['n_items']}: not paired")
        correct, fixed_correct = _correct(t, source), _correct(base, source)
        lost = fixed_correct - correct
        p_min = 1.0 if lost == 0 else float(binomtest(0, abs(lost), 0.5).pvalue)
        rows.append({"model": t["model"], "configuration": t["configuration"], "target_error": t["target_error"],
                     "fixed": fixed, "n_items": int(t["n_items"]), "correct": correct,
                     "fixed_correct": fixed_correct, "lost": lost, "min_discordant": abs(lost),
                     "mcnemar_p_min": p_min})
    if not rows:
        raise ValueError(f"{source}: no target configuration")
    return pd.DataFrame(rows, columns=COLUMNS)


def main(summary: Path, fixed: str, out: Path) -> None:
    table = paired_table(pd.read_csv(summary), fixed, str(summary))
    write_text_atomic(table.to_csv(index=False, float_format="%.6g"), Path(out))  # p-values may be tiny: 6 digits


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(Path(sm.input.summary), str(sm.params.check["fixed"]), Path(sm.output[0]))

"""Accuracy per model, task, setting and configuration of a study's cells (``<outdir>/<study>/accuracy.csv``).

    kvcert-accuracy results/v2/cells/qa/shard-0 ... --out results/v2/accuracy.csv

Accuracy is in points (0-100): per item, the mean correctness over Poisson seeds; then the mean over items,
as the pre-registration's convention for accuracy (claims.yaml ``seed_aggregation``). ``n`` is the number of
items. Descriptive (no test, no verdict): it is what the version-2 population rule is checked against
(full-cache accuracy per task).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from kvcert.analysis import data
from kvcert.analysis.strata import DEFAULT_ALLOCATOR, DEFAULT_SHARE
from kvcert.analysis.errors import AnalysisError
from kvcert.atomic import write_text_atomic
from kvcert.table_columns import DEFENSE_COLUMNS

COLUMNS = ["model", "task", "setting", "policy", "design", "budget", "accuracy", "n"]
# Cells run with a non-uniform allocator carry an ``allocator`` column (kvcert.table_columns.ALLOCATOR_ITEM_COLUMNS);
# when any cell does, the table gains that column after ``policy`` (rows of the other cells say ``uniform``),
# so that one policy's rows under two allocators stay apart. Tables of uniform cells alone are unchanged.
ALLOCATOR = "allocator"
# Likewise the certain-head share (kvcert.table_columns.SHARE_COLUMNS): when any cell ran another share, the table
# gains ``head_fraction`` after ``design``. Only Poisson samples a tail, so only its rows keep their share; the
# full cache and top-k do not depend on it, and their rows say the default, so that the same items run in cells
# of several shares make one row.
SHARE = "head_fraction"
SAMPLED_DESIGN = "poisson"
# Likewise the certificate's defenses (kvcert.table_columns.DEFENSE_COLUMNS, amendment 6): a defended Poisson row's
# policy carries them as the claims do (``cur+lambda0.2+eta0.5``, kvcert.analysis.defended.labelled), so that the
# defended and undefended runs of a scorer make separate rows; the full cache and top-k do not depend on them (a
# defended cell records its defenses on its full-cache rows too), so their rows fold into the undefended one.


def accuracy_points(items: pd.DataFrame) -> float:
    """Accuracy in points (0-100, unrounded) of one configuration's items rows: per item (``data.unit_columns``),
    the mean correctness over its rows (Poisson seeds), then the mean over items; NaN without rows."""
    if not len(items):
        return float("nan")
    per_item = items.groupby(data.unit_columns(items))["correct"].apply(lambda s: s.astype(float).mean())
    return 100 * float(per_item.mean())


def accuracy_table(items: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, task, setting, policy[, allocator], design[, head_fraction], budget) of an items table
    (one row per item, seed and configuration); a defended Poisson configuration's policy names its defenses."""
    columns = list(COLUMNS)
    defenses = [c for c in DEFENSE_COLUMNS if c in items.columns]
    if defenses:
        from kvcert.analysis.defended import labelled  # defended imports the claims, which need not load here

        sampled = items["design"].eq(SAMPLED_DESIGN)
        items = labelled(items.assign(**{c: items[c].where(sampled, 0.0) for c in defenses}))
    if ALLOCATOR in items.columns:
        items = items.assign(**{ALLOCATOR: items[ALLOCATOR].fillna(DEFAULT_ALLOCATOR)})
        columns.insert(columns.index("policy") + 1, ALLOCATOR)
    if SHARE in items.columns:
        share = items[SHARE].astype(float).fillna(DEFAULT_SHARE)
        items = items.assign(**{SHARE: share.where(items["design"].eq(SAMPLED_DESIGN), DEFAULT_SHARE)})
        columns.insert(columns.index("design") + 1, SHARE)
    keys = [c for c in ("model", "task") if c in items.columns] + columns[columns.index("setting"):-2]
    rows = []
    for values, group in items.groupby(keys, sort=True):
        rows.append({**dict(zip(keys, values)), "accuracy": round(accuracy_points(group), 4),
                     "n": int(group.groupby(data.unit_columns(group)).ngroups)})
    return pd.DataFrame(rows).reindex(columns=columns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcert-accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("cells", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        table = accuracy_table(data.load_cells(args.cells, "items"))
        write_text_atomic(table.to_csv(index=False), args.out)
    except AnalysisError as exc:
        print(f"kvcert-accuracy: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Resize a study's design to a cell-time budget, from the times its own cells measured (amendment 3's rule).

    python workflow/scripts/resize_design.py --cells results/v2/cells --budget-minutes 65 --cores 2 \
        --keep oracle --out preregistration/amendment-3/design.yaml

The cost of one item of a cell is the median, over the cell's shards, of the shard's wall seconds
(manifest.json ``wall_seconds.total``) divided by its items: the median, because a shard that shared the
machine with other work reads slower than the design will run. Cells named by ``--keep`` (a prefix, e.g. the
oracle cells) keep their item count and cost their measured total. Every other cell's count is scaled by one
common factor f, the largest for which the estimated cell time fits the budget with ``--cores`` cells at a
time, and rounded down. Reads times only: no item table, answer or verdict.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import yaml

from kvcert.atomic import write_text_atomic


def measured(cells: Path) -> dict[str, dict]:
    """{cell: {"items": n, "seconds": total, "shards": k, "per_item_median": s}} from the shards' manifests."""
    out: dict[str, dict] = {}
    for manifest in sorted(cells.glob("*/shard-*/manifest.json")):
        m = json.loads(manifest.read_text())
        cell = manifest.parent.parent.name
        entry = out.setdefault(cell, {"items": 0, "seconds": 0.0, "shards": 0, "per_shard": []})
        n, seconds = int(m["n_shard_items"]), float(m["wall_seconds"]["total"])
        entry["items"] += n
        entry["seconds"] += seconds
        entry["shards"] += 1
        entry["per_shard"].append(seconds / n)
    if not out:
        raise SystemExit(f"{cells}: no */shard-*/manifest.json")
    for entry in out.values():
        entry["per_item_median"] = statistics.median(entry.pop("per_shard"))
    return out


def resize(cells: dict[str, dict], budget_seconds: float, keep: tuple[str, ...]) -> dict:
    kept = {c: e for c, e in cells.items() if c.startswith(keep)}
    scaled = {c: e for c, e in cells.items() if c not in kept}
    fixed = sum(e["seconds"] for e in kept.values())
    variable = sum(e["items"] * e["per_item_median"] for e in scaled.values())
    factor = (budget_seconds - fixed) / variable
    if factor <= 0:
        raise SystemExit(f"the kept cells alone ({fixed:.0f} cell-seconds) exceed the budget ({budget_seconds:.0f})")
    factor = min(1.0, factor)
    counts = {c: e["items"] for c, e in kept.items()}
    counts.update({c: math.floor(e["items"] * factor) for c, e in scaled.items()})
    estimate = fixed + sum(counts[c] * e["per_item_median"] for c, e in scaled.items())
    return {"factor": round(factor, 4), "counts": dict(sorted(counts.items())),
            "estimated_cell_seconds": round(estimate), "budget_cell_seconds": round(budget_seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=Path, required=True, help="a study's cells/ folder")
    parser.add_argument("--budget-minutes", type=float, required=True, help="wall minutes of cells")
    parser.add_argument("--cores", type=int, default=2, help="cells run at a time")
    parser.add_argument("--keep", nargs="*", default=["oracle"], help="cell-name prefixes whose counts stay")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cells = measured(args.cells)
    result = resize(cells, args.budget_minutes * 60 * args.cores, tuple(args.keep))
    doc = {"rule": __doc__.split("\n\n")[2].replace("\n", " "),
           "inputs": {"cells": str(args.cells), "budget_minutes": args.budget_minutes, "cores": args.cores,
                      "keep": args.keep},
           "measured": {c: {"items": e["items"], "shards": e["shards"], "cell_seconds": round(e["seconds"], 1),
                            "per_item_median_s": round(e["per_item_median"], 2)} for c, e in cells.items()},
           **result}
    text = yaml.safe_dump(doc, sort_keys=False, width=110)
    if args.out:
        write_text_atomic(text, args.out)
    print(text, end="")


if __name__ == "__main__":
    main()

"""Compare recomputed studies' tables with the committed ones (``make verify-results``).

    python workflow/scripts/compare_results.py --fresh results/verify v3 [v1 ...]
    python workflow/scripts/compare_results.py --list        # the studies of workflow/scales/default.yaml
    python workflow/scripts/compare_results.py --committed results/smoke-reference \
        --record-platform results/smoke-reference/platform.json --tables claims.csv reproduction.csv \
        --fresh results/smoke v1 v2                          # the smoke tables against their reference

For each of claims.csv, reproduction.csv and accuracy.csv (``--tables``), the rows of the named studies
(column ``study``) in ``--fresh`` are compared with those in ``--committed`` (default: results) by the smoke
test's platform rule (tests/test_workflow.py):

- byte for byte (the header and the studies' CSV lines) when this machine's numeric platform
  (``kvcert.provenance.numeric_platform``: machine, CPU model, its vector instruction sets, the compiler that
  builds the kernel, torch's CPU capability, torch and transformers versions) equals the record's on every
  component. The record's platform is the one every cell manifest of the studies' committed records states
  (or ``--record-platform``'s JSON file). Manifests written before the CPU model, instruction sets and
  compiler were recorded state only torch's CPU capability, torch and transformers: such a record cannot be
  proven to be this machine's platform (the compiled kernel is built with -march=native, and another CPU
  model of the same capability rounds differently), so it is compared as below;
- elsewhere (another CPU rounds float32 differently): the same rows, every non-float column
  equal (verdicts, agreement, sample sizes, labels), accuracy.csv equal in every column (the accuracies; one
  that differs is also stated as the net number of items it moved, since across CPU models an answer decided
  by near-equal logits can flip),
  and the other floats (estimates, interval ends, coverage, Spearman) equal within ``RTOL``/``ATOL`` or, in a
  row that states its 95% interval (``ci_low``, ``ci_high``), within ``WIDTH_FRACTION`` of the record's
  interval width, whichever is larger.

It prints which comparison it made and why (the platform components that differ or that the record lacks),
then one line per table; the exit status is 1 when any table differs (with the differing values) and 2 on
bad input (one line naming the study, file or column).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.provenance import numeric_platform, platform_differences

TABLES = ("claims.csv", "reproduction.csv", "accuracy.csv")
# Across CPU instruction sets (AVX2 vs AVX512) the float32 kernel sums its 64-term dot products in another
# order: each output moves by up to about 64 unit roundoffs (64 · 2^-24 ≈ 3.8e-6 relative), and an error norm
# ‖ô − o‖ takes that from outputs ten times its size. The smoke tables measured on AVX512 against the AVX2
# reference differ by 1.4e-6 relative in two median relative errors, so 1e-6 refused a correct rerun.
RTOL, ATOL = 1e-5, 1e-9
# A proportion over many indicators moves by whole indicators: the certificate coverage of v3's record (AVX2)
# recomputed on AVX512 counts 2 of its 139,320 step indicators differently (1.5e-5 relative; the flipped rows'
# true error and certificate are both below 2e-6 of the output, i.e. rounding noise, docs/studies/v3.md), which
# RTOL refuses. A number that moves by a hundredth of its own 95% interval's width cannot be told from
# sampling noise and leaves the interval where it was, so such rows also pass within that fraction of the
# record's width (this rule was added after that verification, as docs/studies/v3.md says).
WIDTH_FRACTION = 0.01
# Tables whose floats are accuracies, equal on every platform where the same tokens are generated.
EXACT_TABLES = ("accuracy.csv",)
# What names a row in a difference: the first columns of claims.csv and reproduction.csv, and every key column of
# accuracy.csv (study v5's rows differ only in model, design, budget, allocator or certain-head share).
ROW_KEYS = ("study", "claim", "quantity", "model", "task", "setting", "policy", "design", "budget", "allocator",
            "head_fraction")
TOLERANCE = f"rtol {RTOL:g} (atol {ATOL:g}) or {WIDTH_FRACTION:g} of the row's interval width"
SCALES = Path(__file__).resolve().parents[1] / "scales"


class CompareError(Exception):
    """Bad input: one line naming the study, file or column."""


def known_studies(scales_dir: Path = SCALES) -> list[str]:
    """The studies of the default scale, in its order."""
    from kvcert.scales import load_scale, studies

    return list(studies(load_scale("default", scales_dir)))


def manifest_platform(manifest: dict) -> dict:
    """The numeric platform one cell manifest states: its "numeric_platform", or, in a manifest written
    before that was recorded, the components it does state: torch's CPU capability (top level), torch and
    transformers (under "packages"); it lacks the machine, CPU model, instruction sets and compiler."""
    if isinstance(manifest.get("numeric_platform"), dict):
        return manifest["numeric_platform"]
    packages = manifest.get("packages") or {}
    legacy = {"cpu_capability": manifest.get("cpu_capability"), "torch": packages.get("torch"),
              "transformers": packages.get("transformers")}
    return {k: v for k, v in legacy.items() if v is not None}


def record_platforms(committed: Path, studies: list[str]) -> list[dict]:
    """The distinct numeric platforms the cell manifests of the studies' records state (one when the record
    was made on one platform; none when there is no manifest)."""
    seen = {}
    for study in studies:
        for path in sorted((committed / study / "cells").glob("*/shard-*/manifest.json")):
            platform = manifest_platform(json.loads(path.read_text()))
            seen.setdefault(json.dumps(platform, sort_keys=True), platform)
    return list(seen.values())


def record_platform(committed: Path, studies: list[str]) -> dict | None:
    """The numeric platform every cell manifest of the studies' records states, or None when the manifests
    state none or several."""
    platforms = record_platforms(committed, studies)
    return platforms[0] if len(platforms) == 1 else None


def choose_comparison(record: dict | None, here: dict, unknown: str = "the record states no numeric platform"
                      ) -> tuple[bool, str]:
    """(byte_for_byte, the line saying which comparison and why). Byte for byte only where ``here`` equals
    ``record`` on every component of kvcert.provenance.PLATFORM_COMPONENTS; ``unknown`` is the reason given
    when ``record`` is None."""
    why = [unknown] if record is None else platform_differences(record, here)
    if not why:
        return True, (f"verify-results: this machine's numeric platform equals the record's on every component "
                      f"({here}): byte for byte")
    return False, (f"verify-results: this machine's numeric platform is not proven to be the record's "
                   f"({'; '.join(why)}): verdicts, sample sizes and accuracies equal, other numbers within {TOLERANCE}")


def _study_lines(path: Path, studies: list[str]) -> tuple[str, list[str]]:
    """The header line and the lines of the studies' rows, as written."""
    if not path.is_file():
        raise CompareError(f"{path}: missing")
    lines = path.read_text().splitlines(keepends=True)
    if not lines:
        raise CompareError(f"{path}: empty")
    header = next(csv.reader([lines[0]]))
    if "study" not in header:
        raise CompareError(f"{path}: no column 'study'")
    column = header.index("study")
    body = [line for row, line in zip(csv.reader(lines[1:]), lines[1:]) if row and row[column] in studies]
    return lines[0], body


def _frame(header: str, body: list[str]) -> pd.DataFrame:
    return pd.read_csv(io.StringIO(header + "".join(body)), keep_default_na=False, na_values=[""])


def _plain(value):
    """A numpy scalar as the Python value it holds (its repr is the number, not ``np.float64(...)``)."""
    return value.item() if isinstance(value, np.generic) else value


def _interval_width(frame: pd.DataFrame) -> np.ndarray:
    """Each row's 95% interval width (ci_high - ci_low) in the record; 0 where the row states none."""
    if not {"ci_low", "ci_high"} <= set(frame.columns):
        return np.zeros(len(frame))
    low, high = (pd.to_numeric(frame[c], errors="coerce").to_numpy(float) for c in ("ci_low", "ci_high"))
    return np.nan_to_num(np.abs(high - low), nan=0.0, posinf=0.0)


def compare_table(committed: Path, fresh: Path, studies: list[str], byte_for_byte: bool) -> list[str]:
    """Differences of the studies' rows between two copies of one table (empty when they agree)."""
    (head_a, rows_a), (head_b, rows_b) = _study_lines(committed, studies), _study_lines(fresh, studies)
    if not rows_a:
        raise CompareError(f"{committed}: no row of study {', '.join(studies)}")
    if byte_for_byte:
        if head_a != head_b:
            return [f"header: {head_a.strip()!r} vs {head_b.strip()!r}"]
        return [f"{a.strip()!r} vs {b.strip()!r}" for a, b in zip(rows_a, rows_b) if a != b] + (
            [f"{len(rows_a)} rows vs {len(rows_b)}"] if len(rows_a) != len(rows_b) else [])
    a, b = _frame(head_a, rows_a), _frame(head_b, rows_b)
    if list(a.columns) != list(b.columns):
        return [f"columns {list(a.columns)} vs {list(b.columns)}"]
    if len(a) != len(b):
        return [f"{len(a)} rows vs {len(b)}"]
    exact = committed.name in EXACT_TABLES
    width = _interval_width(a)
    diffs = []
    for column in a.columns:
        x, y = a[column], b[column]
        if not exact and pd.api.types.is_float_dtype(x) and pd.api.types.is_float_dtype(y):
            x_, y_ = x.to_numpy(float), y.to_numpy(float)
            tolerance = np.maximum(ATOL + RTOL * np.abs(y_), WIDTH_FRACTION * width)
            same = (np.abs(x_ - y_) <= tolerance) | (np.isnan(x_) & np.isnan(y_))
        else:
            same = ((x == y) | (x.isna() & y.isna())).to_numpy()
        for i in np.flatnonzero(~same):
            label = " ".join(str(a.at[i, k]) for k in ROW_KEYS if k in a and not pd.isna(a.at[i, k]))
            diffs.append(f"{label}: {column} {_plain(x.iat[i])!r} vs {_plain(y.iat[i])!r}"
                         + (_items_changed(x.iat[i], y.iat[i], a.at[i, "n"]) if column == "accuracy" and "n" in a else ""))
    return diffs


def _items_changed(record: float, rerun: float, n: int) -> str:
    """The accuracy change (in percent) as a net number of the row's n items: ' (net 0.33 of 31 items)'.

    Across CPU models an answer decided by near-equal logits can flip (docs/studies/v5.md, "The run": one of an
    item's three Poisson draws, a third of an item); stating the change in items tells such a flip from a changed
    computation. A row averages each item's draws (seeds) first, so one draw moves it by a fraction of an item."""
    try:
        items = abs(float(rerun) - float(record)) * int(n) / 100
    except (TypeError, ValueError):
        return ""
    return f" (net {items:.2f} of {int(n)} items)"


def compare(committed: Path, fresh: Path, studies: list[str], byte_for_byte: bool,
            tables: tuple[str, ...] = TABLES) -> bool:
    """Print one line per table (and its differences); True when every table agrees."""
    ok = True
    for name in tables:
        diffs = compare_table(committed / name, fresh / name, studies, byte_for_byte)
        if not diffs:
            if byte_for_byte:
                agreed = "identical"
            else:
                agreed = "equal" if name in EXACT_TABLES else f"equal, floats within {TOLERANCE}"
            print(f"verify-results: {name} ({', '.join(studies)}): {agreed}")
            continue
        ok = False
        print(f"verify-results: {name} ({', '.join(studies)}): DIFFERS")
        for line in diffs[:20]:
            print(f"  {line}")
        if len(diffs) > 20:
            print(f"  ... and {len(diffs) - 20} more")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="*", help="studies of workflow/scales/default.yaml")
    parser.add_argument("--committed", type=Path, default=Path("results"))
    parser.add_argument("--fresh", type=Path, help="where the studies were recomputed (make verify-results)")
    parser.add_argument("--list", action="store_true", help="print the default scale's studies and stop")
    parser.add_argument("--check", action="store_true", help="check the study names and stop")
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES),
                        help="the tables to compare (default: all three)")
    parser.add_argument("--record-platform", type=Path,
                        help="a JSON file stating the record's numeric platform (results/smoke-reference/"
                             "platform.json), instead of the studies' cell manifests")
    args = parser.parse_args(argv)
    known = known_studies()
    if args.list:
        print(" ".join(known))
        return 0
    unknown = [s for s in args.studies if s not in known]
    if unknown or not args.studies:
        what = f"STUDIES={' '.join(unknown)}: unknown study" if unknown else "no study named"
        print(f"verify-results: error: {what}; known (workflow/scales/default.yaml): {', '.join(known)}",
              file=sys.stderr)
        return 2
    if args.check:
        return 0
    if args.fresh is None:
        parser.error("--fresh is required")
    if args.record_platform is not None:
        try:
            record = json.loads(args.record_platform.read_text())
        except (OSError, ValueError) as err:
            print(f"verify-results: error: {args.record_platform}: unreadable ({type(err).__name__})", file=sys.stderr)
            return 2
        unknown_reason = f"{args.record_platform} states no platform"
    else:
        platforms = record_platforms(args.committed, args.studies)
        record = platforms[0] if len(platforms) == 1 else None
        unknown_reason = (f"the record's cell manifests state {len(platforms)} different platforms" if platforms
                          else f"no cell manifest of {', '.join(args.studies)} under {args.committed}")
    byte_for_byte, line = choose_comparison(record, numeric_platform(), unknown_reason)
    print(line)
    try:
        return 0 if compare(args.committed, args.fresh, args.studies, byte_for_byte, tuple(args.tables)) else 1
    except CompareError as err:
        print(f"verify-results: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

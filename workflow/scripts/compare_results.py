"""Compare recomputed studies' tables with the committed ones (``make verify-results``).

    python workflow/scripts/compare_results.py --fresh results/verify v3 [v1 ...]
    python workflow/scripts/compare_results.py --list        # the studies of configs/scales/default.yaml
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
  equal (verdicts, agreement, sample sizes, labels), accuracy.csv equal in every column except where near-ties
  explain an accuracy (below), and the other floats (estimates, interval ends, coverage, Spearman) equal within
  ``RTOL``/``ATOL`` or, in a row that states its 95% interval (``ci_low``, ``ci_high``), within
  ``WIDTH_FRACTION`` of the record's interval width, whichever is larger.

Near-ties. Across CPU models an answer decided by a hair can be decided the other way. Each cell shard of a run
since decision margins were recorded has ``decisions.parquet`` (kvcert.runner.decisions: per item and
configuration the decode margin, the draw margin and a digest of what its draws kept; committed records
predate it).
Off the record's platform an accuracy that differs passes only when its change is made of whole flipped answers
(one draw of an item moves its row by 1/(n · draws of the item)) each at a near-tie (kvcert.runner.decisions's
DECODE_RTOL, DRAW_RTOL):

- the record has decisions.parquet: the flipped draws are those whose ``correct`` differs; each must be a
  near-tie by the record's margins: its decode margin, or its draw margin where the rerun's draws kept another
  set; the record's and the rerun's decisions must reproduce both accuracies;
- the record predates them: near-ties per the rerun's own decisions; the change must be a sum of flips of
  near-tie draws (a draw the rerun got right may have been wrong in the record, and the reverse), the fewest
  such flips are named.

Each accepted flip is printed (study, cell, configuration, item, which margin and its value); an accuracy with a
flip that no near-tie explains, or more flips than its near-ties, fails, and so does a study whose accepted flips
outnumber what a correct rerun makes (``flip_bound``: FLIP_RATE per near-tie draw; most Poisson draws carry a
draw near-tie, so their count, not their presence, is what tells a bug from rounding). Verdicts and sample sizes are never
excused; claims.csv and reproduction.csv keep the float rule above, so an accepted flip that moves a claim's
estimate beyond it still fails there. Where the record keeps its cells' items.parquet, ``compare_cells`` compares
them row by row with the same rule (every changed answer a near-tie; other numbers within ``ITEM_RTOL``).

It prints which comparison it made and why (the platform components that differ or that the record lacks),
then one line per table; the exit status is 1 when any table differs (with the differing values) and 2 on
bad input (one line naming the study, file or column).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.provenance import numeric_platform, platform_differences
from kvcert.runner.decisions import DRAW, near_ties

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
# The cell tables a verification reads beside the three: decisions.parquet of every shard (optional in a record).
DECISIONS = "decisions.parquet"
# Per-item numbers of two runs whose answers and retained sets agree (``compare_cells``): float32 logits differ by
# about LOGIT_RTOL (1e-4) relative across CPU models, and an item's means over its steps carry that; ten times it
# relative, and for log-probabilities (a logit minus a log-sum-exp, each moved by 1e-4 of a logit of up to ~50)
# 0.01 absolute.
ITEM_RTOL, LOGPROB_ATOL = 1e-3, 1e-2
# How many flips a correct rerun makes. A near-tie alone says little where draws are concerned: the draw margin is
# the closest of the tens of thousands of |u − π| / π of a Poisson configuration, so most Poisson draws carry one
# (1,443 of the 2,232 of v5's cells oracle-smollm2-share0.8 and qa-smollm2-share0.8, recomputed on an AMD EPYC
# against the Intel Xeon record), and a planted bug's changed answers find near-ties to stand on (SnapKV's
# configurations scored by key norms moved a Poisson row of a small real cell by one draw at a draw margin of
# 5.5e-5, tests/test_decisions.py). What a bug cannot hide is how many answers it changes: that rerun flipped one
# of those 1,443 near-tie draws. So the flips accepted in a study may number no more than a correct rerun makes
# with probability 1 - FLIP_TAIL when each of its near-tie draws (configurations) flips with probability FLIP_RATE
# (above the measured 1 in 1,443): at most 1 flip among 10 near-tie draws, 3 among 100, 8 among 1,443.
FLIP_RATE, FLIP_TAIL = 1e-3, 1e-4
TOLERANCE = f"rtol {RTOL:g} (atol {ATOL:g}) or {WIDTH_FRACTION:g} of the row's interval width"
REPO = Path(__file__).resolve().parents[2]  # the repository: its scale files are kvcert.scales.scales_folder(REPO)


class CompareError(Exception):
    """Bad input: one line naming the study, file or column."""


def known_studies(scales_dir: Path | None = None) -> list[str]:
    """The studies of the default scale (of the repository's scale files unless ``scales_dir``), in its order."""
    from kvcert.scales import load_scale, scales_folder, studies

    return list(studies(load_scale("default", scales_dir or scales_folder(REPO))))


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


def _in_record_order(head_a: str, rows_a: list[str], head_b: str, rows_b: list[str]
                     ) -> tuple[str, list[str], str, list[str]]:
    """Both copies with the record's column order where they hold the same columns in another order. The
    default scale's accuracy.csv concatenates every study's table, and a column only later studies have
    (allocator, head_fraction) goes last; a study recomputed by its own scale writes them where its table has
    them. The order is not a result, so fields are compared by column name: each row is re-written field for
    field (csv quoting alike on both sides), the record's in its own order, the rerun's in the record's."""
    columns_a, columns_b = next(csv.reader([head_a])), next(csv.reader([head_b]))
    if columns_a == columns_b or sorted(columns_a) != sorted(columns_b):
        return head_a, rows_a, head_b, rows_b
    where = [columns_b.index(column) for column in columns_a]

    def line(fields: list[str]) -> str:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerow(fields)
        return out.getvalue()

    rows_a = [line(row) for row in csv.reader(rows_a)]
    rows_b = [line([row[i] for i in where]) for row in csv.reader(rows_b)]
    return line(columns_a), rows_a, line(columns_a), rows_b


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


def compare_table(committed: Path, fresh: Path, studies: list[str], byte_for_byte: bool,
                  explain=None, accepted: list[str] | None = None) -> list[str]:
    """Differences of the studies' rows between two copies of one table (empty when they agree).

    explain: off the record's platform, called for a differing accuracy with (record row, rerun row) as dicts;
    returns the lines naming the flips that explain it (appended to ``accepted``, the difference excused), or
    None (the difference stands)."""
    (head_a, rows_a), (head_b, rows_b) = _study_lines(committed, studies), _study_lines(fresh, studies)
    if not rows_a:
        raise CompareError(f"{committed}: no row of study {', '.join(studies)}")
    head_a, rows_a, head_b, rows_b = _in_record_order(head_a, rows_a, head_b, rows_b)
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
            if column == "accuracy" and explain is not None and _others_equal(a, b, i, column):
                lines = explain(a.iloc[i].to_dict(), b.iloc[i].to_dict())
                if lines is not None:
                    if accepted is not None:
                        accepted.append(f"{label}: accuracy {_plain(x.iat[i])!r} vs {_plain(y.iat[i])!r}, explained by "
                                        f"{len(lines)} near-tie flip{'s' if len(lines) != 1 else ''}:")
                        accepted.extend(f"  {line}" for line in lines)
                    continue
            diffs.append(f"{label}: {column} {_plain(x.iat[i])!r} vs {_plain(y.iat[i])!r}"
                         + (_items_changed(x.iat[i], y.iat[i], a.at[i, "n"]) if column == "accuracy" and "n" in a else ""))
    return diffs


def _others_equal(a: pd.DataFrame, b: pd.DataFrame, i: int, column: str) -> bool:
    """Whether row i of the two frames agrees in every column but ``column`` (its sample size above all)."""
    return all(_plain(a.at[i, c]) == _plain(b.at[i, c]) or (pd.isna(a.at[i, c]) and pd.isna(b.at[i, c]))
               for c in a.columns if c != column)


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


def study_decisions(root: Path, study: str) -> pd.DataFrame | None:
    """Every decisions.parquet of a study's cell shards under ``root`` (``<root>/<study>/cells/<cell>/shard-<k>/``),
    with columns ``cell`` ("<cell>/shard-<k>") added; None when no shard has one (a record that predates them).
    Read once per root and study (every differing accuracy row of a study reads the same files)."""
    key = (str(root), study)
    if key not in _DECISIONS_READ:
        _DECISIONS_READ[key] = _read_decisions(root, study)
    return _DECISIONS_READ[key]


_DECISIONS_READ: dict[tuple[str, str], pd.DataFrame | None] = {}


def _read_decisions(root: Path, study: str) -> pd.DataFrame | None:
    paths = sorted((root / study / "cells").glob(f"*/shard-*/{DECISIONS}"))
    if not paths:
        return None
    frames = []
    for path in paths:
        try:
            frame = pd.read_parquet(path)
        except Exception as err:  # noqa: BLE001 - any unreadable file is bad input, named
            raise CompareError(f"{path}: unreadable ({type(err).__name__})") from None
        frames.append(frame.assign(cell=f"{path.parent.parent.name}/{path.parent.name}"))
    return pd.concat(frames, ignore_index=True)


def _row_decisions(decisions: pd.DataFrame, row: dict) -> pd.DataFrame:
    """The decisions rows of one accuracy.csv row: its model, task, setting, policy, design, budget, allocator
    (none stated: uniform) and, for design poisson, its certain-head share (the other designs' rows pool every
    share, kvcert.analysis.accuracy)."""
    mask = np.ones(len(decisions), bool)
    for key in ("model", "task", "setting", "policy", "design"):
        if key in row and key in decisions:
            mask &= (decisions[key].astype(str) == str(row[key])).to_numpy()
    mask &= np.isclose(decisions["budget"].to_numpy(float), float(row["budget"]), atol=1e-9)
    allocator = row.get("allocator")
    mask &= (decisions["allocator"] == (allocator if isinstance(allocator, str) and allocator else "uniform")).to_numpy()
    share = row.get("head_fraction")
    if row.get("design") == "poisson" and share is not None and not pd.isna(share):
        mask &= np.isclose(decisions["head_fraction"].to_numpy(float), float(share), atol=1e-9)
    return decisions[mask]


def _accuracy(rows: pd.DataFrame) -> float:
    """An accuracy.csv accuracy of decisions rows: per item the mean over its draws, then the mean over items."""
    return round(100 * float(rows.groupby("item_id")["correct"].mean().mean()), 4)


def _configuration(row) -> str:
    share = f" share {float(row['head_fraction']):g}" if row["design"] == "poisson" else ""
    allocator = f" {row['allocator']}" if row["allocator"] != "uniform" else ""
    return (f"{row['cell']} {row['policy']} {row['design']} {float(row['budget']):g}{allocator}{share} seed "
            f"{int(row['seed'])} item {row['item_id']}")


def _flip(study: str, row, kind: str, value: float, correct: tuple[bool, bool], per: str) -> str:
    return (f"{study} {_configuration(row)}: correct {correct[0]} -> {correct[1]}, {kind} {value:.3g} "
            f"(near-tie per {per})")


def explain_accuracy(committed: Path, fresh: Path, record: dict, rerun: dict) -> list[str] | None:
    """The near-tie flips that explain a differing accuracy row (record vs rerun, accuracy.csv rows as dicts), one
    line each; None when they cannot (no decisions, a flip without a near-tie, more flips than near-ties)."""
    study = str(record["study"])
    ours = study_decisions(fresh, study)
    if ours is None:
        return None
    ours = _row_decisions(ours, rerun)
    theirs = study_decisions(committed, study)
    if theirs is not None:
        theirs = _row_decisions(theirs, record)
    if len(ours) == 0 or _accuracy(ours) != round(float(rerun["accuracy"]), 4):
        return None  # the rerun's decisions do not describe its table
    if theirs is not None and len(theirs):
        return _flips_per_record(study, theirs, ours, record)
    return _flips_per_rerun(study, ours, float(record["accuracy"]), float(rerun["accuracy"]), int(record["n"]))


def _flips_per_record(study: str, theirs: pd.DataFrame, ours: pd.DataFrame, record: dict) -> list[str] | None:
    """Exact: the draws whose answer changed, each a near-tie by the record's margins (a draw margin counts only
    where the rerun's draws kept another set)."""
    if _accuracy(theirs) != round(float(record["accuracy"]), 4):
        return None
    keys = ["cell", "item_id", "policy", "design", "budget", "seed", "allocator", "head_fraction"]
    both = theirs.merge(ours, on=keys, suffixes=("", "_rerun"), how="outer", indicator=True)
    if not (both["_merge"] == "both").all():
        return None  # the two runs decided different sets of draws
    lines = []
    for _, row in both[both["correct"] != both["correct_rerun"]].iterrows():
        ties = near_ties(row)
        if row["draws_sha256"] == row["draws_sha256_rerun"]:
            ties.pop(DRAW, None)  # the same tokens retained: the draws did not decide this
        if not ties:
            return None
        kind, value = next(iter(ties.items()))
        lines.append(_flip(study, row, kind, value, (bool(row["correct"]), bool(row["correct_rerun"])), "the record"))
    return lines or None


def _flips_per_rerun(study: str, ours: pd.DataFrame, before: float, after: float, n: int) -> list[str] | None:
    """The record has no decisions: the fewest near-tie draws of the rerun whose flips make the change
    (accuracies in points, n items); None when no set of them does."""
    draws = ours.groupby("item_id")["seed"].transform("size").to_numpy(int)
    scale = int(np.lcm.reduce(np.unique(draws)))  # one draw of an item is scale / draws in these units
    change = (after - before) * n / 100 * scale
    target = int(round(change))
    # accuracies are written to 4 decimals: each end may be off by 5e-5 points
    if abs(change - target) > 1e-4 * n / 100 * scale + 1e-9:
        return None
    candidates = []
    for position, (_, row) in enumerate(ours.iterrows()):
        ties = near_ties(row)
        if ties:  # a draw the rerun got right may have been wrong in the record (+), and the reverse (-)
            weight = scale // draws[position]
            candidates.append((weight if row["correct"] else -weight, row, *next(iter(ties.items()))))
    # fewest flips reaching the target: a breadth-first search over reachable sums
    reach = {0: []}
    for weight, row, kind, value in candidates:
        for total, chosen in list(reach.items()):
            new = total + weight
            if new not in reach or len(reach[new]) > len(chosen) + 1:
                reach[new] = chosen + [(weight, row, kind, value)]
    if target == 0 or target not in reach:
        return None
    per = "the rerun: the record predates decision margins"
    return [_flip(study, row, kind, value, (not bool(row["correct"]), bool(row["correct"])), per)
            for _, row, kind, value in reach[target]]


def compare_cells(record: Path, rerun: Path, label: str = "") -> tuple[list[str], list[str]]:
    """(differences, accepted flips) of two runs of one cell shard, row by row of items.parquet: the same rows;
    an answer (prediction or correct) that changed must be a near-tie by the record's decisions.parquet (the
    rerun's where the record has none): its decode margin, or its draw margin where the draws kept another set;
    draws that kept another set must be a draw near-tie; the other numbers within ITEM_RTOL (log-probabilities
    LOGPROB_ATOL)."""
    def load(folder: Path, name: str) -> pd.DataFrame | None:
        path = folder / name
        if not path.is_file():
            if name == DECISIONS:
                return None
            raise CompareError(f"{path}: missing")
        try:
            return pd.read_parquet(path)
        except Exception as err:  # noqa: BLE001 - any unreadable file is bad input, named
            raise CompareError(f"{path}: unreadable ({type(err).__name__})") from None

    items_a, items_b = load(record, "items.parquet"), load(rerun, "items.parquet")
    dec_a, dec_b = load(record, DECISIONS), load(rerun, DECISIONS)
    if dec_b is None:
        raise CompareError(f"{rerun / DECISIONS}: missing (the rerun must record its decisions)")
    margins, per = (dec_a, "the record") if dec_a is not None else (dec_b, "the rerun: the record predates decision margins")
    keys = [c for c in ("item_id", "policy", "design", "budget", "seed", "setting", "allocator", "head_fraction")
            if c in items_a.columns]
    if list(items_a.columns) != list(items_b.columns):
        return [f"{label}items.parquet columns {list(items_a.columns)} vs {list(items_b.columns)}"], []
    both = items_a.merge(items_b, on=keys, suffixes=("", "_rerun"), how="outer", indicator=True)
    if not (both["_merge"] == "both").all():
        return [f"{label}items.parquet: {int((both['_merge'] != 'both').sum())} rows in one run only"], []
    dkeys = ["item_id", "policy", "design", "budget", "seed"]
    margins = margins.set_index(dkeys)
    digests = dec_b.set_index(dkeys)["draws_sha256"]
    diffs, accepted = [], []
    floats = [c for c in items_a.columns if c not in keys and pd.api.types.is_float_dtype(items_a[c])]
    for _, row in both.iterrows():
        key = tuple(row[k] for k in dkeys)
        name = f"{label}{row['policy']} {row['design']} {float(row['budget']):g} seed {int(row['seed'])} item {row['item_id']}"
        decided = margins.loc[key] if key in margins.index else None
        if isinstance(decided, pd.DataFrame):
            decided = decided.iloc[0]
        moved = (dec_a is not None and decided is not None and key in digests.index
                 and decided["draws_sha256"] != digests.loc[key])
        ties = near_ties(decided) if decided is not None else {}
        if not moved and dec_a is not None:
            ties.pop(DRAW, None)  # the same tokens retained: the draws did not decide it
        changed = row["prediction"] != row["prediction_rerun"] or row["correct"] != row["correct_rerun"]
        if changed or moved:
            if not ties:
                what = "answer" if changed else "sample (what the draws kept)"
                diffs.append(f"{name}: {what} changed ({row['prediction']!r} -> {row['prediction_rerun']!r}, correct "
                             f"{row['correct']} -> {row['correct_rerun']}) with no near-tie (decode margin "
                             f"{_margin(decided, 'decode_margin')}, draw margin {_margin(decided, 'draw_margin')})")
            elif changed:
                kind, value = next(iter(ties.items()))
                accepted.append(f"{name}: correct {row['correct']} -> {row['correct_rerun']}, {kind} {value:.3g} "
                                f"(near-tie per {per})")
            continue
        for column in floats:
            x, y = float(row[column]), float(row[f"{column}_rerun"])
            if math.isnan(x) and math.isnan(y):
                continue
            tolerance = LOGPROB_ATOL if column.startswith("logprob") else ITEM_RTOL * max(abs(x), abs(y))
            if not abs(x - y) <= tolerance:
                diffs.append(f"{name}: {column} {x!r} vs {y!r}")
    return diffs, accepted


def compare_study_cells(committed: Path, fresh: Path, study: str) -> bool:
    """Where the record keeps its cells' items.parquet (``<committed>/<study>/cells/<cell>/shard-<k>/``), compare
    each shard with the rerun's (``compare_cells``), printing the accepted flips and the differences; True when
    they agree or the record keeps none (committed records keep only their manifests and configs: nothing to say)."""
    shards = sorted(p.parent for p in (committed / study / "cells").glob("*/shard-*/items.parquet"))
    if not shards:
        return True
    ok, flips, ties = True, 0, 0
    for shard in shards:
        name = f"{study} {shard.parent.name}/{shard.name}"
        diffs, accepted = compare_cells(shard, fresh / shard.relative_to(committed), f"{name} ")
        flips += len(accepted)
        if accepted:  # the margins that judged them: the record's, else the rerun's
            judged = next((p / DECISIONS for p in (shard, fresh / shard.relative_to(committed))
                           if (p / DECISIONS).is_file()), None)
            ties += near_tie_draws(pd.read_parquet(judged)) if judged is not None else 0
        for line in accepted:
            print(f"verify-results: cells: accepted {line}")
        if diffs:
            ok = False
            print(f"verify-results: cells: {name}: DIFFERS")
            for line in diffs[:20]:
                print(f"  {line}")
            if len(diffs) > 20:
                print(f"  ... and {len(diffs) - 20} more")
    too_many = too_many_flips(study, flips, ties, "its cells")
    if too_many is not None:
        ok = False
        print(f"verify-results: cells ({study}): DIFFERS")
        print(f"  {too_many}")
    if ok:
        print(f"verify-results: cells ({study}): {len(shards)} shards agree row by row"
              + (f" but for {flips} near-tie flips (above)" if flips else ""))
    return ok


def flip_bound(near_tie_draws: int) -> int:
    """The most flips a correct rerun makes among ``near_tie_draws`` near-tie configurations: the smallest k with
    P(Poisson(FLIP_RATE · near_tie_draws) > k) <= FLIP_TAIL."""
    rate = FLIP_RATE * max(int(near_tie_draws), 0)
    k, term = 0, math.exp(-rate)
    below = term  # P(X <= k)
    while 1.0 - below > FLIP_TAIL:
        k += 1
        term *= rate / k
        below += term
    return k


def near_tie_draws(decisions: pd.DataFrame | None) -> int:
    """How many configurations (rows) of a decisions table carry a near-tie of either kind."""
    if decisions is None or not len(decisions):
        return 0
    return int(sum(bool(near_ties(row)) for row in decisions[["decode_margin", "decided_logit", "draw_margin"]]
                   .to_dict("records")))


def too_many_flips(study: str, flips: int, ties: int, where: str) -> str | None:
    """The line saying that ``flips`` accepted flips are more than a correct rerun makes (``flip_bound`` of
    ``ties``, the near-tie draws of the margins that judged them), or None."""
    bound = flip_bound(ties)
    if flips <= bound:
        return None
    return (f"{study}: {flips} near-tie flips in {where}, more than a correct rerun makes: at most {bound} of its "
            f"{ties} near-tie draws (each flipping at rate {FLIP_RATE:g}, tail {FLIP_TAIL:g})")


def _margin(decided, column: str) -> str:
    return "unknown" if decided is None else f"{float(decided[column]):.3g}"


def compare(committed: Path, fresh: Path, studies: list[str], byte_for_byte: bool,
            tables: tuple[str, ...] = TABLES) -> bool:
    """Print one line per table (and its differences, and the near-tie flips it accepted); True when every
    table agrees. Off the record's platform an accuracy may differ by near-tie flips (``explain_accuracy``)."""
    ok = True
    for name in tables:
        accepted: list[str] = []
        explain = None if byte_for_byte else (lambda r, f: explain_accuracy(committed, fresh, r, f))
        diffs = compare_table(committed / name, fresh / name, studies, byte_for_byte, explain, accepted)
        if accepted:  # the flips accepted per study, against what a correct rerun makes
            for study in studies:
                flips = sum(1 for line in accepted if line.startswith(f"  {study} "))
                judged = study_decisions(committed, study)
                ties = near_tie_draws(judged if judged is not None else study_decisions(fresh, study))
                line = too_many_flips(study, flips, ties, f"{name}'s rows")
                if line is not None:
                    diffs.append(line)
        for line in accepted:
            print(f"verify-results: {name}: accepted {line}" if not line.startswith("  ") else f"  {line}")
        if not diffs:
            if byte_for_byte:
                agreed = "identical"
            else:
                agreed = "equal" if name in EXACT_TABLES else f"equal, floats within {TOLERANCE}"
                if accepted:
                    rows = sum(1 for line in accepted if not line.startswith("  "))
                    agreed += f" but for {rows} accurac{'ies' if rows != 1 else 'y'} explained by near-tie flips (above)"
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
    parser.add_argument("studies", nargs="*", help="studies of configs/scales/default.yaml")
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
        print(f"verify-results: error: {what}; known (configs/scales/default.yaml): {', '.join(known)}",
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
        ok = compare(args.committed, args.fresh, args.studies, byte_for_byte, tuple(args.tables))
        if not byte_for_byte:  # on the record's platform the tables' bytes already say everything
            ok = all([compare_study_cells(args.committed, args.fresh, study) for study in args.studies]) and ok
        return 0 if ok else 1
    except CompareError as err:
        print(f"verify-results: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

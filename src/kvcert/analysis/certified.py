"""Reading an exploratory certified-budgets study's cells (workflow/scripts/certified_budgets.py, its diagnostics
notebook): every cell's items, steps and target choices with their configuration columns, and the bracket of the
error relative to the full cache's output.

A configuration is one (cell, design, budget) of one model, labelled from the columns the cell's recorded
``config.yaml`` gives (``target_error``, ``target_delta``, ``target_floor``, ``allocator``; a key left out holds what
its absence means, kvcert.run_schema.ABSENT_MEANS) and the rows' design and budget, never parsed from the cell's
name: ``fixed topk 0.25``, ``adakv poisson 0.5`` (a cell without a target: its variant, design and budget),
``target 0.1`` (design poisson with a target error at the study's cap, STUDY_CAP; at another cap it is named:
``target 0.1 cap 1``), ``target 0.1 floor 0.25`` (with ``target_floor``, every KV head keeping at least that
fraction; the default floor, half of each cap, names its cap: ``target 0.1 floor 0.25 cap 0.5``), ``clt 0.1`` (the
same cell's design clt: the peers' decode-time CLT-sized sampler at the same ε and δ; it keeps the whole cache),
and ``full`` (the full cache). Each row's colour family (``family``: fixed, adakv, pyramidkv, target, uncapped,
floored, clt) comes from the same columns.

The relative error. The target is on ‖ô − o‖/‖o‖ (o the full cache's output); steps.parquet stores ‖ô − o‖
(``true_err``) and ‖ô‖ (``out_norm``), not ‖o‖. Since ‖ô‖ − e ≤ ‖o‖ ≤ ‖ô‖ + e (e = ‖ô − o‖), the error relative to
‖o‖ lies in [e/(‖ô‖ + e), e/(‖ô‖ − e)] (``with_bounds``: ``err_low``, ``err_high``; ``err_stored`` = e/‖ô‖).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.exploratory import load_cell_table
from kvcert.run_schema import ABSENT_MEANS, FLOOR_SHARE_OF_CAP, HALF_CAP

KEYS = ["item_id", "policy", "design", "budget", "seed", "setting"]
# The columns read of each cell table (kvcert.analysis.exploratory.load_cell_table checks them; a target cell writes targets)
READS = {"items": [*KEYS, "correct", "retained_tokens", "context_tokens", "full_bytes"],
         "steps": [*KEYS, "step", "layer", "kv_head", "true_err", "out_norm"],
         "targets": [*KEYS, "layer", "kv_head", "expected_count", "context_tokens", "met"]}

def error_bounds(true_err: np.ndarray, out_norm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(low, high, stored) relative errors per step row: ‖ô − o‖/‖o‖ lies in [low, high]; stored = e/‖ô‖.

    true_err, out_norm: (rows,) ‖ô − o‖ and ‖ô‖. high is +inf where e ≥ ‖ô‖ (‖o‖ may be 0 there); stored is +inf
    where ‖ô‖ = 0 < e and 0 where both vanish.
    """
    e = np.asarray(true_err, dtype=np.float64)
    norm = np.asarray(out_norm, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        low = np.where(e > 0, e / (norm + e), 0.0)
        high = np.where(e > 0, np.where(norm > e, e / (norm - e), np.inf), 0.0)
        stored = np.where(e > 0, np.where(norm > 0, e / norm, np.inf), 0.0)
    return low, high, stored


# The study's cap (the budget of its target_<eps> cells): a target at another cap is named by its cap.
STUDY_CAP = 0.5
# The configuration columns a cell's config.yaml records (a key left out holds what its absence means).
CONFIG_COLUMNS = ("target_error", "target_delta", "target_floor", "allocator")


def recorded_config(cell_dirs) -> dict:
    """CONFIG_COLUMNS as the cell's shards recorded them in config.yaml (kvcert.runner.cell.config_yaml), the same in
    every shard; a key a config leaves out holds kvcert.run_schema.ABSENT_MEANS's value (a null floor, no target,
    the uniform allocator). Raises AnalysisError naming the file for a missing, unreadable or disagreeing config."""
    found = None
    for d in cell_dirs:
        path = Path(d) / "config.yaml"
        if not path.is_file():
            raise AnalysisError(f"{path}: missing (every input cell records its config.yaml)")
        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise AnalysisError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(config, dict):
            raise AnalysisError(f"{path}: expected a mapping of run config keys")
        values = {key: config.get(key, ABSENT_MEANS[key]) for key in CONFIG_COLUMNS}
        if found is not None and values != found:
            raise AnalysisError(f"{path}: {values} differs from the cell's other shards' {found}")
        found = values
    return found


def configuration_name(variant: str, design: str, budget: float, target_error, target_floor=np.nan,
                       floor_default: bool = False) -> str:
    """A row's configuration label from its columns (the module docstring); ``variant`` (the cell's name in the
    scale) labels only a cell without a target."""
    if design == "full":
        return "full"
    if design == "clt":
        return f"clt {target_error:g}"
    if pd.notna(target_error):
        name = f"target {target_error:g}" + (f" floor {target_floor:g}" if pd.notna(target_floor) else "")
        return f"{name} cap {budget:g}" if floor_default or float(budget) != STUDY_CAP else name
    return f"{variant} {design} {budget:g}"


def family(design: str, budget: float, target_error, target_floor, allocator: str) -> str:
    """A row's colour family from its columns: full, clt, the targets (target at the study's cap, uncapped at
    another, floored with a floor) and, without a target, its allocator (fixed: uniform)."""
    if design in ("full", "clt"):
        return design
    if pd.notna(target_error):
        return "floored" if pd.notna(target_floor) else "target" if float(budget) == STUDY_CAP else "uncapped"
    return "fixed" if allocator == "uniform" else str(allocator)


def load(cells: dict) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(items, steps, choices) of every cell, each row tagged with model, variant, the configuration columns
    (CONFIG_COLUMNS, from the cell's recorded config; target_floor as a fraction, the default half_cap resolved per
    row's budget, ``floor_default`` marking it), configuration and family.

    cells: {cell: {"model", "variant" (its name in the scale), "dirs": [shard dirs]}}. The full cache is kept once
    per model (every cell decodes it on the same items): from the first cell listed.
    """
    items, steps, choices, full_seen = [], [], [], set()

    def read(spec, table, tags, floor):
        frame = load_cell_table(spec["dirs"], table, READS[table]).assign(**tags)
        if floor == HALF_CAP:  # the default floor, per configuration: half its cap
            frame["target_floor"] = FLOOR_SHARE_OF_CAP * frame["budget"].astype(float)
        return frame

    for cell, spec in cells.items():
        config = recorded_config(spec["dirs"])
        target, floor = config["target_error"], config["target_floor"]
        tags = {"model": spec["model"], "variant": spec["variant"],
                "target_error": np.nan if target is None else float(target),
                "target_delta": np.nan if config["target_delta"] is None else float(config["target_delta"]),
                "target_floor": np.nan if floor in (None, HALF_CAP) else float(floor),
                "floor_default": floor == HALF_CAP, "allocator": str(config["allocator"])}
        cell_items = read(spec, "items", tags, floor)
        if spec["model"] in full_seen:
            cell_items = cell_items[cell_items["policy"] != "full"].copy()
        full_seen.add(spec["model"])
        is_full = cell_items["policy"] == "full"
        cell_items.loc[is_full, "variant"] = "full"
        cell_items.loc[is_full, ["target_error", "target_delta", "target_floor"]] = np.nan
        cell_items.loc[is_full, ["allocator", "floor_default"]] = ["uniform", False]
        items.append(cell_items)
        steps.append(read(spec, "steps", tags, floor))
        if target is not None:
            choices.append(read(spec, "targets", tags, floor))
    out = [pd.concat(f, ignore_index=True) if f else pd.DataFrame() for f in (items, steps, choices)]
    for frame in out:
        if len(frame):
            design = np.where(frame["policy"] == "full", "full", frame["design"]) if "policy" in frame else frame["design"]
            columns = list(zip(frame["variant"], design, frame["budget"], frame["target_error"],
                               frame["target_floor"], frame["floor_default"], frame["allocator"]))
            frame["configuration"] = [configuration_name(v, d, b, t, f, fd) for v, d, b, t, f, fd, _ in columns]
            frame["family"] = [family(d, b, t, f, a) for _, d, b, t, f, _, a in columns]
    return out[0], out[1], out[2]


def with_bounds(steps: pd.DataFrame) -> pd.DataFrame:
    s = steps[np.isfinite(steps["true_err"]) & np.isfinite(steps["out_norm"])].copy()
    s["err_low"], s["err_high"], s["err_stored"] = error_bounds(s["true_err"].to_numpy(), s["out_norm"].to_numpy())
    return s


def levels(target, epsilons: list[float]) -> list[float]:
    """The ε a configuration is measured at: a target (or clt) at its own, anything else at each study level."""
    return [float(target)] if pd.notna(target) else [float(e) for e in epsilons]


HEAD_KEYS = ["model", "configuration", *KEYS, "layer", "kv_head"]


def met(choices: pd.DataFrame) -> pd.DataFrame:
    """A target's choice per (HEAD_KEYS): whether its prediction met ε (``met``, bool)."""
    return choices[HEAD_KEYS].assign(met=choices["met"].astype(bool))

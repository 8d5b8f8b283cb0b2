"""Exploratory certified-budgets tables (rule ``certified_budgets``; the figure is drawn from them by rule
``certified_budgets_figure``, workflow/scripts/certified_budgets_figure.py): what a target relative error buys
against fixed budgets and budget allocators, on the cells of an exploratory study whose analysis is
``certified_budgets`` (workflow/scales/certified-budgets.yaml). Descriptive numbers, never a pre-registered test.

A configuration is one (cell, design, budget) of one model, labelled from the cell's recorded config
(kvcert.analysis.certified, which reads the cells). Tables, under the study's folder:

* ``summary.csv``, per model and configuration: accuracy (%, items' ``correct``), kept fraction (mean of
  retained_tokens / context_tokens), kept bytes (items' ``kept_bytes`` where an allocator cell writes it,
  elsewhere full_bytes · retained_tokens / context_tokens, the retained slots' bytes when every slot of every
  layer has one size, as in the bundled models; a target cell's ``cache_bytes`` pads each layer to its longest
  head), the realized relative error over every decode (step, layer, KV head) row, and its coverage of each
  study level ε.
* ``coverage_by_layer.csv``: that coverage per layer, next to 1 − δ.
* ``coverage_by_step.csv``: that coverage per decode step (0 = the first generated token's), next to 1 − δ: where
  the answer's queries leave what the observation window predicted.
* ``targets.csv``, per target configuration and layer (and ``layer`` = all): the share of (item, KV head) whose
  prediction met ε, and the prediction-vs-decode gap: among the decode rows of heads predicted to meet ε, the
  share whose realized error exceeds ε; beside it the coverage of ε on the other heads' decode rows (those whose
  prediction missed ε even at the cap, so they keep the cap). A target's coverage in ``summary.csv`` is the
  row-weighted mix of the two, which says whether a difference in coverage between workloads comes from the
  prediction or from how many heads the cap binds.

The certificate's diagnostics (certificate_flags.csv, certificate_items.csv, certificate_heads.csv), added after the
held-out checks were read, are the notebook workflow/notebooks/certified_diagnostics.py.ipynb's (rule
``notebook_certified_diagnostics``; kvcert.analysis.certificate_diagnostics).

The relative error. The target is on ‖ô − o‖/‖o‖ (o the full cache's output); steps.parquet stores ‖ô − o‖
(``true_err``) and ‖ô‖ (``out_norm``), not ‖o‖. Since ‖ô‖ − e ≤ ‖o‖ ≤ ‖ô‖ + e (e = ‖ô − o‖), the error relative to
‖o‖ lies in [e/(‖ô‖ + e), e/(‖ô‖ − e)] (the upper end infinite where e ≥ ‖ô‖), so its coverage of ε is bracketed:
``coverage_low`` counts rows whose upper end is within ε (certainly covered), ``coverage_high`` rows whose lower
end is (possibly covered). ``coverage_stored`` is the coverage of e/‖ô‖ (the stored ``rel_err``, the form of the
step table's ``rel_cert``). The gap is bracketed the same way (``exceed_low`` ≤ gap ≤ ``exceed_high``).
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.accuracy import accuracy_points
from kvcert.analysis.certified import (  # noqa: F401 (the cells' reader, with the names tests use)
    HEAD_KEYS, KEYS, READS, STUDY_CAP, configuration_name, error_bounds, family, levels as _levels, load,
    met as _met, recorded_config, with_bounds as _with_bounds)
from kvcert.atomic import write_text_atomic

SUMMARY_COLUMNS = ["model", "configuration", "variant", "allocator", "design", "budget", "target_error", "n_items",
                   "accuracy", "kept_fraction", "kept_bytes", "kept_bytes_fraction", "n_step_rows",
                   "rel_err_median", "rel_err_p95"]
LAYER_COLUMNS = ["model", "configuration", "epsilon", "layer", "n_step_rows", "coverage_low", "coverage_high",
                 "coverage_stored", "level"]
STEP_COLUMNS = ["model", "configuration", "epsilon", "step", "n_step_rows", "coverage_low", "coverage_high",
                "coverage_stored", "level"]
TARGET_COLUMNS = ["model", "configuration", "target_error", "layer", "n_heads", "heads_met", "expected_fraction",
                  "n_met_step_rows", "exceed_low", "exceed_high", "exceed_stored", "met_heads_exceeding",
                  "n_capped_step_rows", "capped_coverage_low", "capped_coverage_high"]


def summary_table(items: pd.DataFrame, steps: pd.DataFrame, epsilons: list[float]) -> pd.DataFrame:
    kept_bytes = (items["kept_bytes"] if "kept_bytes" in items else pd.Series(np.nan, index=items.index))
    estimate = items["full_bytes"] * items["retained_tokens"] / items["context_tokens"]
    items = items.assign(kept_fraction=items["retained_tokens"] / items["context_tokens"],
                         kept=kept_bytes.where(kept_bytes.notna(), estimate).astype(float))
    items = items.assign(kept_bytes_fraction=items["kept"] / items["full_bytes"])
    rows = []
    for (model, configuration), g in items.groupby(["model", "configuration"], sort=False):
        first = g.iloc[0]
        s = steps[(steps["model"] == model) & (steps["configuration"] == configuration)]
        row = {"model": model, "configuration": configuration, "variant": first["variant"],
               "allocator": first["allocator"], "design": "full" if first["policy"] == "full" else first["design"], "budget": float(first["budget"]), "target_error": first["target_error"],
               "n_items": int(g["item_id"].nunique()), "accuracy": accuracy_points(g),
               "kept_fraction": g["kept_fraction"].mean(), "kept_bytes": g["kept"].mean(),
               "kept_bytes_fraction": g["kept_bytes_fraction"].mean(), "n_step_rows": int(len(s)),
               "rel_err_median": float(s["err_stored"].median()) if len(s) else np.nan,
               "rel_err_p95": float(s["err_stored"].quantile(0.95)) if len(s) else np.nan}
        for eps in epsilons:
            for form in ("low", "high", "stored"):
                row[f"coverage_{form}_{eps:g}"] = _coverage(s, eps, form)
        rows.append(row)
    columns = SUMMARY_COLUMNS + [f"coverage_{form}_{eps:g}" for eps in epsilons for form in ("low", "high", "stored")]
    return pd.DataFrame(rows, columns=columns)


def _coverage(s: pd.DataFrame, eps: float, form: str) -> float:
    """Share of rows whose relative error is within eps: form low -> its upper bound (certainly covered), high ->
    its lower bound (possibly covered), stored -> e/‖ô‖."""
    if not len(s):
        return np.nan
    column = {"low": "err_high", "high": "err_low", "stored": "err_stored"}[form]
    return float((s[column] <= eps).mean())


def _coverage_by(steps: pd.DataFrame, by: str, epsilons: list[float], delta: float) -> list[dict]:
    rows = []
    for (model, configuration, value), s in steps.groupby(["model", "configuration", by], sort=True):
        target = s["target_error"].iloc[0]
        for eps in _levels(target, epsilons):
            rows.append({"model": model, "configuration": configuration, "epsilon": float(eps), by: int(value),
                         "n_step_rows": int(len(s)), "coverage_low": _coverage(s, eps, "low"),
                         "coverage_high": _coverage(s, eps, "high"), "coverage_stored": _coverage(s, eps, "stored"),
                         "level": 1 - delta})
    return rows


def coverage_by_layer(steps: pd.DataFrame, epsilons: list[float], delta: float) -> pd.DataFrame:
    """Per model, configuration, ε and layer: the coverage bracket of ‖ô − o‖/‖o‖ ≤ ε and e/‖ô‖ ≤ ε, beside
    1 − δ. A target configuration is measured at its own ε only."""
    return pd.DataFrame(_coverage_by(steps, "layer", epsilons, delta), columns=LAYER_COLUMNS)


def coverage_by_step(steps: pd.DataFrame, epsilons: list[float], delta: float) -> pd.DataFrame:
    """As coverage_by_layer, per decode step instead of per layer (every layer and KV head of the step pooled)."""
    return pd.DataFrame(_coverage_by(steps, "step", epsilons, delta), columns=STEP_COLUMNS)


def target_table(choices: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per target configuration, per layer and over all layers (``layer`` = "all"): how many (item, KV head)
    predictions met ε, the mean expected count as a share of the context, and among the decode rows of heads
    predicted to meet ε, the share exceeding ε (bracketed as the coverage is: ``exceed_low`` counts rows certainly
    above ε, ``exceed_high`` rows possibly above; ``exceed_stored`` on e/‖ô‖), and the share of met (item, KV head)
    with at least one decode row certainly above ε (``met_heads_exceeding``); and on the decode rows of the heads
    whose prediction missed ε (they keep the cap), the coverage bracket of ε (``capped_coverage_low`` /
    ``capped_coverage_high``, as in ``summary.csv``)."""
    if not len(choices):
        return pd.DataFrame(columns=TARGET_COLUMNS)
    met = choices.assign(met=choices["met"].astype(bool))
    decode = steps[steps["target_error"].notna()].merge(_met(choices), on=HEAD_KEYS, how="inner",
                                                        validate="many_to_one")
    rows = []
    for (model, configuration), c in met.groupby(["model", "configuration"], sort=False):
        eps = float(c["target_error"].iloc[0])
        rows_of_cell = decode[(decode["model"] == model) & (decode["configuration"] == configuration)]
        for layer in ["all", *sorted(c["layer"].unique())]:
            cl = c if layer == "all" else c[c["layer"] == layer]
            rl = rows_of_cell if layer == "all" else rows_of_cell[rows_of_cell["layer"] == layer]
            dl, cap = rl[rl["met"]], rl[~rl["met"]]  # rows of heads predicted to meet ε / of heads at the cap
            head_keys = [*KEYS, "layer", "kv_head"]
            certainly_over = dl.groupby(head_keys)["err_low"].max() > eps if len(dl) else pd.Series(dtype=bool)
            rows.append({"model": model, "configuration": configuration, "target_error": eps,
                         "layer": layer if layer == "all" else int(layer), "n_heads": int(len(cl)),
                         "heads_met": float(cl["met"].mean()),
                         "expected_fraction": float((cl["expected_count"] / cl["context_tokens"]).mean()),
                         "n_met_step_rows": int(len(dl)),
                         "exceed_low": float((dl["err_low"] > eps).mean()) if len(dl) else np.nan,
                         "exceed_high": float((dl["err_high"] > eps).mean()) if len(dl) else np.nan,
                         "exceed_stored": float((dl["err_stored"] > eps).mean()) if len(dl) else np.nan,
                         "met_heads_exceeding": float(certainly_over.mean()) if len(dl) else np.nan,
                         "n_capped_step_rows": int(len(cap)), "capped_coverage_low": _coverage(cap, eps, "low"),
                         "capped_coverage_high": _coverage(cap, eps, "high")})
    return pd.DataFrame(rows, columns=TARGET_COLUMNS)


def main(cells: dict, epsilons: list[float], delta: float, out_dir: Path) -> None:
    items, steps, choices = load(cells)
    steps = _with_bounds(steps)
    summary = summary_table(items, steps, epsilons)
    by_step = coverage_by_step(steps, epsilons, delta)
    tables = {"summary": summary, "coverage_by_layer": coverage_by_layer(steps, epsilons, delta),
              "coverage_by_step": by_step, "targets": target_table(choices, steps)}
    for name, table in tables.items():  # the rule's outputs: exploratory.smk's CERTIFIED_TABLES, in this order
        write_text_atomic(table.round(6).to_csv(index=False), Path(out_dir) / f"{name}.csv")


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(dict(sm.params.cells), [float(e) for e in sm.params.epsilons], float(sm.params.delta),
         Path(sm.output.summary).parent)

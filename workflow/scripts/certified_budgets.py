"""Exploratory certified-budgets tables and figure (rule ``certified_budgets``): what a target relative error buys
against fixed budgets and budget allocators, on the cells of an exploratory study whose analysis is
``certified_budgets`` (workflow/scales/certified-budgets.yaml). Descriptive numbers, never a pre-registered test.

A configuration is one (cell, design, budget) of one model, labelled from the columns the cell's recorded
``config.yaml`` gives (``target_error``, ``target_delta``, ``target_floor``, ``allocator``; a key left out holds what
its absence means, kvcert.run_schema.ABSENT_MEANS) and the rows' design and budget, never parsed from the cell's
name: ``fixed topk 0.25``, ``adakv poisson 0.5`` (a cell without a target: its variant, design and budget),
``target 0.1`` (design poisson with a target error at the study's cap, STUDY_CAP; at another cap it is named:
``target 0.1 cap 1``), ``target 0.1 floor 0.25`` (with ``target_floor``, every KV head keeping at least that
fraction; the default floor, half of each cap, names its cap: ``target 0.1 floor 0.25 cap 0.5``), ``clt 0.1`` (the
same cell's design clt: the peers' decode-time CLT-sized sampler at the same ε and δ; it keeps the whole cache),
and ``full`` (the full cache). Each row's colour family (``family``: fixed, adakv, pyramidkv, target, uncapped,
floored, clt) comes from the same columns. Tables, under
the study's folder:

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
* ``certificate_flags.csv``, per configuration with a certificate (design poisson), ε and layer (and ``layer`` =
  all): what the certificate reported at each decode step, in the relative form a user sees while decoding
  (``rel_cert`` = ε̂_δ/‖ô‖), against the realized error: the share of decode rows above ε, the share the
  certificate flags (its relative form above ε), the share of the rows certainly above ε that it flags
  (``caught``), and the rows above ε that it does not flag (``silent_low`` certainly above, ``silent_high``
  possibly above, as shares of every row; the certificate at level δ promises that its own bound is exceeded on at
  most about δ of them). For a target, also the share of the met heads' decode rows it flags (``met_flagged``):
  the prediction's misses that the decoding certificate itself reports. Added after the held-out checks 1 to 3
  were read; exploratory, as the whole study.
* ``certificate_items.csv``, per configuration with a certificate and ε: per item, the share of its decode rows
  the certificate flags and the share certainly above ε, averaged over the items answered right and over those
  answered wrong, and the area under the ROC curve of each share as a score for a wrong answer (``auc_flagged``,
  ``auc_above``; 0.5: no information; empty where every item has the same outcome). Added with the table above.
* ``certificate_heads.csv``, per configuration with a certificate, ε, layer and KV head: the head's mean
  realized error (e/‖ô‖) and mean ``rel_cert`` over its decode rows, the shares flagged, certainly above ε and
  silent (certainly above, not flagged), for a target the mean kept share of the context (expected count over
  context tokens) and the share of items whose prediction met ε, and the head's ``rank`` by mean error within
  its configuration and ε (1: the largest). Where a pooled share hides a few heads. Added with the tables above.

The relative error. The target is on ‖ô − o‖/‖o‖ (o the full cache's output); steps.parquet stores ‖ô − o‖
(``true_err``) and ‖ô‖ (``out_norm``), not ‖o‖. Since ‖ô‖ − e ≤ ‖o‖ ≤ ‖ô‖ + e (e = ‖ô − o‖), the error relative to
‖o‖ lies in [e/(‖ô‖ + e), e/(‖ô‖ − e)] (the upper end infinite where e ≥ ‖ô‖), so its coverage of ε is bracketed:
``coverage_low`` counts rows whose upper end is within ε (certainly covered), ``coverage_high`` rows whose lower
end is (possibly covered). ``coverage_stored`` is the coverage of e/‖ô‖ (the stored ``rel_err``, the form of the
step table's ``rel_cert``). The gap is bracketed the same way (``exceed_low`` ≤ gap ≤ ``exceed_high``).
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from kvcert.analysis.accuracy import accuracy_points  # noqa: E402
from kvcert.analysis.exploratory import load_cell_table  # noqa: E402
from kvcert.analysis.figures import save_figure  # noqa: E402
from kvcert.analysis.stats import auc  # noqa: E402
from kvcert.atomic import write_text_atomic  # noqa: E402
from kvcert.analysis.errors import AnalysisError  # noqa: E402
from kvcert.run_schema import ABSENT_MEANS, FLOOR_SHARE_OF_CAP, HALF_CAP  # noqa: E402

KEYS = ["item_id", "policy", "design", "budget", "seed", "setting"]
# The columns read of each cell table (kvcert.analysis.exploratory.load_cell_table checks them; a target cell writes targets)
READS = {"items": [*KEYS, "correct", "retained_tokens", "context_tokens", "full_bytes"],
         "steps": [*KEYS, "step", "layer", "kv_head", "true_err", "out_norm"],
         "targets": [*KEYS, "layer", "kv_head", "expected_count", "context_tokens", "met"]}
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
FLAG_COLUMNS = ["model", "configuration", "sizing", "family", "epsilon", "layer", "n_step_rows", "above_low",
                "above_high", "flagged", "caught", "silent_low", "silent_high", "n_met_step_rows", "met_flagged",
                "level"]


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


def _with_bounds(steps: pd.DataFrame) -> pd.DataFrame:
    s = steps[np.isfinite(steps["true_err"]) & np.isfinite(steps["out_norm"])].copy()
    s["err_low"], s["err_high"], s["err_stored"] = error_bounds(s["true_err"].to_numpy(), s["out_norm"].to_numpy())
    return s


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


def _levels(target, epsilons: list[float]) -> list[float]:
    """The ε a configuration is measured at: a target (or clt) at its own, anything else at each study level."""
    return [float(target)] if pd.notna(target) else [float(e) for e in epsilons]


HEAD_KEYS = ["model", "configuration", *KEYS, "layer", "kv_head"]


def _met(choices: pd.DataFrame) -> pd.DataFrame:
    """A target's choice per (HEAD_KEYS): whether its prediction met ε (``met``, bool)."""
    return choices[HEAD_KEYS].assign(met=choices["met"].astype(bool))


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


def _certified(steps: pd.DataFrame) -> pd.DataFrame:
    """The decode rows that carry a certificate (design poisson; top-k and clt have none)."""
    return steps[np.isfinite(steps["rel_cert"])] if "rel_cert" in steps else steps.iloc[:0]


def _flag_row(s: pd.DataFrame, eps: float) -> dict:
    """The flag columns of decode rows ``s`` (with err_low, err_high, rel_cert and met, NaN where not a target)."""
    above_low, above_high = s["err_low"].to_numpy() > eps, s["err_high"].to_numpy() > eps
    flagged = s["rel_cert"].to_numpy() > eps
    met = s["met"].to_numpy() == True  # noqa: E712 (NaN outside a target: not met)
    return {"n_step_rows": int(len(s)), "above_low": float(above_low.mean()), "above_high": float(above_high.mean()),
            "flagged": float(flagged.mean()),
            "caught": float(flagged[above_low].mean()) if above_low.any() else np.nan,
            "silent_low": float((above_low & ~flagged).mean()), "silent_high": float((above_high & ~flagged).mean()),
            "n_met_step_rows": int(met.sum()), "met_flagged": float(flagged[met].mean()) if met.any() else np.nan}


def certificate_flags(choices: pd.DataFrame, steps: pd.DataFrame, epsilons: list[float], delta: float) -> pd.DataFrame:
    """Per model, configuration with a certificate, ε (a target's own, else each study level) and layer (and
    ``layer`` = "all"): how the certificate reported while decoding compares with the realized error
    (FLAG_COLUMNS; the module docstring), with the configuration's sizing (``target`` where it has a target error,
    else ``fixed``) and colour family (``fixed``, ``adakv``, ``target``, ``floored`` ...). A row is flagged where
    ``rel_cert`` (ε̂_δ/‖ô‖: ‖o‖ is unknown while decoding) exceeds ε; a row is above ε certainly where err_low > ε,
    possibly where err_high > ε."""
    s = _certified(steps)
    if len(choices) and len(s):
        s = s.merge(_met(choices), on=HEAD_KEYS, how="left", validate="many_to_one")
    else:
        s = s.assign(met=np.nan)
    rows = []
    for (model, configuration), c in s.groupby(["model", "configuration"], sort=False):
        target = c["target_error"].iloc[0]
        sizing = "fixed" if pd.isna(target) else "target"
        family = c["family"].iloc[0]
        for eps in _levels(target, epsilons):
            for layer in ["all", *sorted(c["layer"].unique())]:
                cl = c if layer == "all" else c[c["layer"] == layer]
                rows.append({"model": model, "configuration": configuration, "sizing": sizing, "family": family,
                             "epsilon": float(eps),
                             "layer": layer if layer == "all" else int(layer), **_flag_row(cl, float(eps)),
                             "level": 1 - delta})
    return pd.DataFrame(rows, columns=FLAG_COLUMNS)


ITEM_COLUMNS = ["model", "configuration", "epsilon", "n_items", "n_wrong", "flagged_right", "flagged_wrong",
                "above_right", "above_wrong", "auc_flagged", "auc_above"]


def certificate_items(items: pd.DataFrame, steps: pd.DataFrame, epsilons: list[float]) -> pd.DataFrame:
    """Per model, configuration with a certificate and ε (as certificate_flags): whether an item's share of
    flagged decode rows (``rel_cert`` > ε) or of rows certainly above ε tells a wrong answer from a right one
    (ITEM_COLUMNS; the module docstring). An item is wrong where its ``correct`` is false."""
    s = _certified(steps)
    rows = []
    for (model, configuration), c in s.groupby(["model", "configuration"], sort=False):
        target = c["target_error"].iloc[0]
        outcome = items.loc[(items["model"] == model) & (items["configuration"] == configuration),
                            ["model", "configuration", *KEYS, "correct"]]
        for eps in _levels(target, epsilons):
            shares = (c.assign(flag=c["rel_cert"] > eps, above=c["err_low"] > eps)
                      .groupby(["model", "configuration", *KEYS])[["flag", "above"]].mean().reset_index()
                      .merge(outcome, on=["model", "configuration", *KEYS], how="inner", validate="one_to_one"))
            wrong = ~shares["correct"].astype(bool)
            both = wrong.nunique() == 2
            # the mean shares of the right (False) and wrong (True) items; NaN where there are none
            mean = shares.groupby(wrong)[["flag", "above"]].mean().reindex([False, True])
            rows.append({"model": model, "configuration": configuration, "epsilon": float(eps),
                         "n_items": int(len(shares)), "n_wrong": int(wrong.sum()),
                         "flagged_right": float(mean.loc[False, "flag"]),
                         "flagged_wrong": float(mean.loc[True, "flag"]),
                         "above_right": float(mean.loc[False, "above"]),
                         "above_wrong": float(mean.loc[True, "above"]),
                         "auc_flagged": float(auc(shares["flag"], wrong)) if both else np.nan,
                         "auc_above": float(auc(shares["above"], wrong)) if both else np.nan})
    return pd.DataFrame(rows, columns=ITEM_COLUMNS)


HEAD_COLUMNS = ["model", "configuration", "epsilon", "layer", "kv_head", "n_step_rows", "rel_err_mean",
                "rel_cert_mean", "flagged", "above_low", "silent_low", "kept_fraction", "heads_met", "rank"]


def certificate_heads(choices: pd.DataFrame, steps: pd.DataFrame, epsilons: list[float]) -> pd.DataFrame:
    """Per model, configuration with a certificate, ε (as certificate_flags), layer and KV head: HEAD_COLUMNS (the
    module docstring); kept_fraction and heads_met are empty outside a target."""
    s = _certified(steps)
    head = ["layer", "kv_head"]
    frames = []
    for (model, configuration), c in s.groupby(["model", "configuration"], sort=False):
        target = c["target_error"].iloc[0]
        chosen = choices[(choices["model"] == model) & (choices["configuration"] == configuration)] \
            if len(choices) else pd.DataFrame()
        kept = (chosen.assign(kept_fraction=chosen["expected_count"] / chosen["context_tokens"],
                              heads_met=chosen["met"].astype(float)).groupby(head)[["kept_fraction", "heads_met"]]
                .mean() if len(chosen) else None)
        for eps in _levels(target, epsilons):
            flag, above = c["rel_cert"] > eps, c["err_low"] > eps
            g = (c.assign(flagged=flag, above_low=above, silent_low=above & ~flag)
                 .groupby(head).agg(n_step_rows=("err_stored", "size"), rel_err_mean=("err_stored", "mean"),
                                    rel_cert_mean=("rel_cert", "mean"), flagged=("flagged", "mean"),
                                    above_low=("above_low", "mean"), silent_low=("silent_low", "mean")))
            g = (g.join(kept, how="left") if kept is not None else g.assign(kept_fraction=np.nan, heads_met=np.nan)
                 ).reset_index()
            g["rank"] = g["rel_err_mean"].rank(ascending=False, method="first").astype(int)
            frames.append(g.assign(model=model, configuration=configuration, epsilon=float(eps)))
    if not frames:
        return pd.DataFrame(columns=HEAD_COLUMNS)
    return pd.concat(frames, ignore_index=True)[HEAD_COLUMNS]


FAMILY_COLORS = {"fixed": "tab:blue", "adakv": "tab:orange", "pyramidkv": "tab:green", "target": "tab:red",
                 "uncapped": "tab:brown", "floored": "tab:olive", "clt": "tab:purple"}
FAMILY_LABELS = {"uncapped": "target, cap 1", "floored": "target, floor"}
# drawn as stars: the study's targets, the same with no cap and with a floor
TARGET_FAMILIES = ("target", "uncapped", "floored")
DESIGN_MARKERS = {"topk": "s", "poisson": "o", "clt": "X"}
# A small horizontal offset per allocator family, so that equal results (AdaKV on one KV head, PyramidKV where it
# falls back to uniform) stay visible side by side.
FAMILY_DODGE = {"fixed": -0.012, "adakv": 0.0, "pyramidkv": 0.012}


def _family(row) -> str:
    """The colour group of a row (its ``family`` column, from the configuration columns: see ``family``)."""
    return str(row["family"])


def with_family(table: pd.DataFrame, items: pd.DataFrame) -> pd.DataFrame:
    """``table`` (rows per model and configuration) with each configuration's ``family`` column from ``items``."""
    families = items.groupby(["model", "configuration"], sort=False)["family"].first().reset_index()
    return table.merge(families, on=["model", "configuration"], how="left", validate="many_to_one")


def _step_panel(ax, by_step: pd.DataFrame, model: str, epsilons: list[float], delta: float) -> None:
    """The decode rows certainly within ε per decode step: each target at its own ε (solid at the largest ε,
    dashed below it) and the fixed Poisson budget of one half at each ε, in its family's colour; 1 − δ dotted."""
    m = by_step[by_step["model"] == model]
    for configuration, g in m.groupby("configuration", sort=False):
        family = g["family"].iloc[0]  # the by_step rows carry their configuration's family (with_family)
        if family not in TARGET_FAMILIES and configuration != "fixed poisson 0.5":
            continue
        for eps, e in g.groupby("epsilon", sort=False):
            ax.plot(e["step"], e["coverage_low"], color=FAMILY_COLORS.get(family, "0.3"), lw=1.2,
                    ls="-" if eps >= max(epsilons) else "--", alpha=0.85)
    ax.axhline(1 - delta, color="black", lw=0.8, ls=":")
    ax.set_xlabel("decode step")


def _marker_style(r, family: str) -> dict:
    """A summary row's marker: its family's colour, its design's marker (targets as stars), budgets below 50% hollow."""
    is_target = family in TARGET_FAMILIES
    color = FAMILY_COLORS.get(family, "0.3")
    hollow = not is_target and family != "clt" and float(r["budget"]) < 0.5
    return dict(marker="*" if is_target else DESIGN_MARKERS.get(r["design"], "o"), ms=13 if is_target else 7,
                ls="none", color=color, markerfacecolor="none" if hollow else color, markeredgewidth=1.4, alpha=0.85)


def _flag_panel(ax, flags: pd.DataFrame, summary: pd.DataFrame, model: str, delta: float) -> None:
    """Per configuration with a certificate and ε (all layers): the decode rows possibly above ε (x) against those
    of them the per-step certificate left unflagged (y, ``silent_high``); y = x is a certificate that flags
    nothing, y = δ dotted what a certificate at level δ allows."""
    rows = flags[(flags["model"] == model) & (flags["layer"].astype(str) == "all")].merge(
        summary[summary["model"] == model].drop(columns="family"), on=["model", "configuration"], how="inner")
    for _, r in rows.iterrows():
        ax.plot(r["above_high"], r["silent_high"], **_marker_style(r, _family(r)))
    top = max(1.5 * delta, 1.2 * float(rows["silent_high"].max())) if len(rows) else 1.5 * delta
    ax.axline((0, 0), slope=1, color="0.5", lw=0.8, ls="-.")
    ax.axhline(delta, color="black", lw=0.8, ls=":")
    ax.set_ylim(0, top)
    ax.set_xlim(left=0)
    ax.set_xlabel("decode rows possibly above eps")


def figure(summary: pd.DataFrame, by_step: pd.DataFrame, epsilons: list[float], delta: float, png: Path,
           pdf: Path, flags: pd.DataFrame | None = None) -> None:
    """Per model (columns): kept bytes (share of the full cache) on x; accuracy and the realized error's 95th
    percentile (e/‖ô‖) on y. Colour: the cell family (fixed budgets, AdaKV, PyramidKV, the targets, the peers'
    sampler); marker: the design (targets as stars); budgets below 50% hollow, 50% filled; the study's ε as dashed
    lines, the full cache's accuracy dotted. Third row: the decode rows certainly within ε per decode step
    (``_step_panel``); last row, given ``flags`` (certificate_flags.csv): what the per-step certificate left
    unflagged of the rows above ε (``_flag_panel``)."""
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(summary["model"]))
    n_rows = 3 if flags is None else 4
    fig, axes = plt.subplots(n_rows, len(models), figsize=(4.8 * len(models), 3.2 * n_rows), squeeze=False)
    for col in range(len(models)):
        axes[0, col].sharex(axes[1, col])
    for col, model in enumerate(models):
        m = summary[summary["model"] == model]
        full = m[m["configuration"] == "full"]
        if len(full):
            axes[0, col].axhline(float(full["accuracy"].iloc[0]), color="black", lw=0.8, ls=":")
        for _, r in m[m["configuration"] != "full"].iterrows():
            family = _family(r)
            is_target = family in TARGET_FAMILIES
            color = FAMILY_COLORS.get(family, "0.3")
            style = _marker_style(r, family)
            x = float(r["kept_bytes_fraction"]) + FAMILY_DODGE.get(family, 0.0)
            axes[0, col].plot(x, r["accuracy"], **style)
            axes[1, col].plot(x, r["rel_err_p95"], **style)
            if family in ("uncapped", "floored"):  # which ε, in the error panel right of its star (the accuracy
                # panel has the capped targets' labels next to it; the error panel separates the two ε by height)
                axes[1, col].annotate(f"ε={r['target_error']:g}", (x, r["rel_err_p95"]), textcoords="offset points",
                                      xytext=(8, -3), fontsize=7, color=color)
            elif is_target or family == "clt":  # which ε, in the accuracy panel: a target's above (the largest ε)
                # or below its star, clt's to the left of its cross (at the right edge: it keeps the whole cache)
                above = float(r["target_error"]) >= max(epsilons)
                offset = (-40, -3) if family == "clt" else (-8, 9 if above else -13)
                axes[0, col].annotate(f"ε={r['target_error']:g}", (x, r["accuracy"]), textcoords="offset points",
                                      xytext=offset, fontsize=7, color=color)
        for eps in epsilons:
            axes[1, col].axhline(eps, color="0.4", lw=0.7, ls="--")
        axes[0, col].set_title(model)
        axes[1, col].set_xlabel("kept bytes / full cache bytes")
        axes[1, col].set_yscale("log")
        for ax in axes[:2, col]:  # room for the labels right of the rightmost stars (both panels share x)
            ax.margins(x=0.15)
        _step_panel(axes[2, col], by_step, model, epsilons, delta)
        if flags is not None:
            _flag_panel(axes[3, col], flags, summary, model, delta)
    axes[0, 0].set_ylabel("accuracy (%)")
    axes[1, 0].set_ylabel("95th pct of ||o_hat - o|| / ||o_hat||")
    axes[2, 0].set_ylabel("decode rows certainly within eps")
    if flags is not None:
        axes[3, 0].set_ylabel("rows above eps, certificate silent")
    # The legend names only what is drawn (the held-out checks have no clt; the first has no budget below 0.5).
    drawn = summary[summary["configuration"] != "full"].to_dict("records")
    families = {_family(r) for r in drawn}
    hollow_drawn = any(_family(r) not in (*TARGET_FAMILIES, "clt") and float(r["budget"]) < 0.5 for r in drawn)
    handles = [Line2D([], [], color=c, marker="o", ls="none", label=FAMILY_LABELS.get(name, name))
               for name, c in FAMILY_COLORS.items() if name in families]
    handles += [Line2D([], [], color="0.3", marker=mk, ls="none", label=name) for name, mk in DESIGN_MARKERS.items()
                if any(r["design"] == name and _family(r) not in TARGET_FAMILIES for r in drawn)]
    handles += [Line2D([], [], color="0.3", marker="*", ms=11, ls="none", label="target (poisson)")]
    handles += [Line2D([], [], color="0.3", marker="o", markerfacecolor="none", ls="none", label="budget < 0.5")
                ] if hollow_drawn else []
    handles += [Line2D([], [], color="0.3", marker="o", ls="none", label="budget 0.5"),
                Line2D([], [], color="black", ls=":", label="full cache, 1 - delta, delta"),
                Line2D([], [], color="0.4", ls="--", label="target errors"),
                Line2D([], [], color="0.3", ls="-", label=f"per step: eps {max(epsilons):g}"),
                Line2D([], [], color="0.3", ls="--", label="per step: smaller eps")]
    handles += [Line2D([], [], color="0.5", ls="-.", label="no flag at all")] if flags is not None else []
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=7, frameon=False)
    fig.suptitle("Exploratory: certified budgets")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save_figure(fig, png, pdf)


def main(cells: dict, epsilons: list[float], delta: float, out_dir: Path, png: Path, pdf: Path) -> None:
    items, steps, choices = load(cells)
    steps = _with_bounds(steps)
    summary = summary_table(items, steps, epsilons)
    by_step = coverage_by_step(steps, epsilons, delta)
    flags = certificate_flags(choices, steps, epsilons, delta)
    tables = {"summary": summary, "coverage_by_layer": coverage_by_layer(steps, epsilons, delta),
              "coverage_by_step": by_step, "targets": target_table(choices, steps), "certificate_flags": flags,
              "certificate_items": certificate_items(items, steps, epsilons),
              "certificate_heads": certificate_heads(choices, steps, epsilons)}
    for name, table in tables.items():  # the rule's outputs: exploratory.smk's CERTIFIED_TABLES, in this order
        write_text_atomic(table.round(6).to_csv(index=False), Path(out_dir) / f"{name}.csv")
    figure(with_family(summary, items), with_family(by_step, items), epsilons, delta, png, pdf, flags)


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(dict(sm.params.cells), [float(e) for e in sm.params.epsilons], float(sm.params.delta),
         Path(sm.output.summary).parent, Path(sm.output.png), Path(sm.output.pdf))

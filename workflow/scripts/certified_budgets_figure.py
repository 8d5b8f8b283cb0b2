"""The exploratory certified-budgets figure (rule ``certified_budgets_figure``), drawn from the study's tables
(summary.csv and coverage_by_step.csv, rule ``certified_budgets``) and its cells' recorded configs, never from the
cells' parquet tables: a committed study's figure is redrawn from its committed results (``make redraw
SCALE=<name>``). Descriptive, never a pre-registered test.
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvcert.analysis.certified import family, recorded_config  # noqa: E402
from kvcert.analysis.errors import AnalysisError  # noqa: E402
from kvcert.analysis.exploratory import read_study_table  # noqa: E402
from kvcert.analysis.figures import save_figure  # noqa: E402
from kvcert.run_schema import FLOOR_SHARE_OF_CAP, HALF_CAP  # noqa: E402

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


def families(summary: pd.DataFrame, cells: dict) -> pd.DataFrame:
    """[model, configuration, family] per summary row, from its columns (design, budget, target_error, allocator)
    and the floor its cell recorded (config.yaml, kvcert.analysis.certified.recorded_config): summary.csv has no
    floor column, and a floored target differs from an unfloored one only there. The full cache has no cell."""
    floors = {}
    for spec in cells.values():
        floor = recorded_config(spec["dirs"])["target_floor"]
        floors[(spec["model"], spec["variant"])] = floor
    rows = []
    for r in summary.to_dict("records"):
        if r["design"] == "full":
            rows.append({"model": r["model"], "configuration": r["configuration"], "family": "full"})
            continue
        key = (r["model"], r["variant"])
        if key not in floors:
            raise AnalysisError(f"summary.csv: row {r['model']} / {r['configuration']} names variant "
                                f"{r['variant']!r}, which no cell of the study has")
        floor = floors[key]
        # the default floor (half_cap) is a floor too: it resolves per row to a share of the cap
        resolved = np.nan if floor is None else FLOOR_SHARE_OF_CAP * float(r["budget"]) if floor == HALF_CAP \
            else float(floor)
        rows.append({"model": r["model"], "configuration": r["configuration"],
                     "family": family(r["design"], r["budget"], r["target_error"], resolved, r["allocator"])})
    return pd.DataFrame(rows, columns=["model", "configuration", "family"]).drop_duplicates()


def with_family(table: pd.DataFrame, family_of: pd.DataFrame) -> pd.DataFrame:
    """``table`` (rows per model and configuration) with each configuration's ``family`` column."""
    return table.merge(family_of, on=["model", "configuration"], how="left", validate="many_to_one")


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


def figure(summary: pd.DataFrame, by_step: pd.DataFrame, epsilons: list[float], delta: float, png: Path,
           pdf: Path) -> None:
    """Per model (columns): kept bytes (share of the full cache) on x; accuracy and the realized error's 95th
    percentile (e/‖ô‖) on y. Colour: the cell family (fixed budgets, AdaKV, PyramidKV, the targets, the peers'
    sampler); marker: the design (targets as stars); budgets below 50% hollow, 50% filled; the study's ε as dashed
    lines, the full cache's accuracy dotted. Third row: the decode rows certainly within ε per decode step
    (``_step_panel``). What the per-step certificate flagged is the diagnostics notebook's figure
    (kvcert.analysis.certificate_diagnostics)."""
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(summary["model"]))
    n_rows = 3
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
    axes[0, 0].set_ylabel("accuracy (%)")
    axes[1, 0].set_ylabel("95th pct of ||o_hat - o|| / ||o_hat||")
    axes[2, 0].set_ylabel("decode rows certainly within eps")
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
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=7, frameon=False)
    fig.suptitle("Exploratory: certified budgets")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save_figure(fig, png, pdf)


def main(summary_csv: Path, by_step_csv: Path, cells: dict, epsilons: list[float], delta: float, png: Path,
         pdf: Path) -> None:
    summary = read_study_table(summary_csv, ["model", "configuration", "variant", "allocator", "design", "budget",
                                             "target_error", "accuracy", "kept_bytes_fraction", "rel_err_p95"],
                               "rule certified_budgets")
    by_step = read_study_table(by_step_csv, ["model", "configuration", "epsilon", "step", "coverage_low"],
                               "rule certified_budgets")
    family_of = families(summary, cells)
    figure(with_family(summary, family_of), with_family(by_step, family_of), epsilons, delta, png, pdf)


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(Path(sm.input.summary), Path(sm.input.coverage_by_step), dict(sm.params.cells),
         [float(e) for e in sm.params.epsilons], float(sm.params.delta), Path(sm.output.png), Path(sm.output.pdf))

"""Exploratory sensitivity table and figure (rule ``sensitivity_table``): how accuracy, the C1 and C2
estimates and certificate coverage move with one knob at a time, on the cells of an exploratory study.

Each variant is one cell (SnapKV top-k and Poisson at the base budgets, the full cache, the oracle on). Per
variant and budget: full, top-k and Poisson accuracy (points; Poisson seeds averaged per item), the C1-style
differences (top-k − full, Poisson − full) and the C2-style difference (Poisson − top-k), each paired over
items with a 95% percentile bootstrap interval (1000 item resamples, seeded), and the coverage of
√(tr V̂/δ) over all (step, layer, KV head) rows of the Poisson design, with its worst layer. These are
descriptive numbers, not the pre-registered tests.
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvcert.analysis.figures import save_figure  # noqa: E402
from kvcert.atomic import write_text_atomic  # noqa: E402

DELTA = 0.05
N_BOOT = 1000
COLUMNS = ["variant", "knob", "value", "budget", "n_items", "acc_full", "acc_topk", "acc_poisson",
           "topk_minus_full", "topk_minus_full_lo", "topk_minus_full_hi",
           "poisson_minus_full", "poisson_minus_full_lo", "poisson_minus_full_hi",
           "poisson_minus_topk", "poisson_minus_topk_lo", "poisson_minus_topk_hi",
           "coverage", "worst_layer", "worst_layer_coverage", "median_rel_cert"]


def _per_item(items: pd.DataFrame, policy: str, design: str, budget: float) -> pd.Series:
    rows = items[(items["policy"] == policy) & (items["design"] == design) & np.isclose(items["budget"], budget)]
    return rows.groupby("item_id")["correct"].mean().astype(float)


def _paired(a: pd.Series, b: pd.Series, seed: int) -> tuple[float, float, float]:
    """Mean of a − b over common items (points) with a percentile bootstrap interval."""
    d = 100 * (a - b).dropna().to_numpy()
    rng = np.random.default_rng(seed)
    boots = d[rng.integers(0, len(d), size=(N_BOOT, len(d)))].mean(axis=1)
    return float(d.mean()), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def summarize(variant: str, knob: str, value, cells: list[str]) -> list[dict]:
    items = pd.concat([pd.read_parquet(Path(c) / "items.parquet") for c in cells], ignore_index=True)
    steps = pd.concat([pd.read_parquet(Path(c) / "steps.parquet") for c in cells], ignore_index=True)
    full = items[items["policy"] == "full"].groupby("item_id")["correct"].mean().astype(float)
    rows = []
    for budget in sorted(items.loc[items["policy"] != "full", "budget"].unique()):
        topk = _per_item(items, "snapkv", "topk", budget)
        poisson = _per_item(items, "snapkv", "poisson", budget)
        s = steps[(steps["policy"] == "snapkv") & (steps["design"] == "poisson") & np.isclose(steps["budget"], budget)]
        s = s[np.isfinite(s["true_err"]) & np.isfinite(s["trace_var"])]
        covered = s["true_err"] <= np.sqrt(s["trace_var"] / DELTA)
        by_layer = covered.groupby(s["layer"]).mean()
        row = {"variant": variant, "knob": knob, "value": value, "budget": float(budget), "n_items": int(len(full)),
               "acc_full": 100 * full.mean(), "acc_topk": 100 * topk.mean(), "acc_poisson": 100 * poisson.mean(),
               "coverage": float(covered.mean()), "worst_layer": int(by_layer.idxmin()),
               "worst_layer_coverage": float(by_layer.min()), "median_rel_cert": float(s["rel_cert"].median())}
        for name, (a, b) in {"topk_minus_full": (topk, full), "poisson_minus_full": (poisson, full),
                             "poisson_minus_topk": (poisson, topk)}.items():
            row[name], row[f"{name}_lo"], row[f"{name}_hi"] = _paired(a, b, seed=17)
        rows.append(row)
    return rows


def figure(table: pd.DataFrame, knobs: dict, png: Path, pdf: Path) -> None:
    fig, axes = plt.subplots(3, len(knobs), figsize=(3.2 * len(knobs), 8.2), squeeze=False, sharey="row")
    for col, knob in enumerate(knobs):
        rows = table[table["knob"] == knob]
        for budget, g in rows.groupby("budget"):
            g = g.sort_values("order")
            x = np.arange(len(g))
            for name, style in (("acc_full", ":"), ("acc_topk", "--"), ("acc_poisson", "-")):
                axes[0, col].plot(x, g[name], style, marker="o", ms=3, label=f"{name[4:]}, budget {budget:g}")
            for name, offset in (("poisson_minus_full", -0.1), ("poisson_minus_topk", 0.1)):
                axes[1, col].errorbar(x + offset, g[name], yerr=[g[name] - g[f"{name}_lo"], g[f"{name}_hi"] - g[name]],
                                      fmt="o", ms=3, capsize=2, label=f"{name}, budget {budget:g}")
            axes[2, col].plot(x, g["coverage"], "-o", ms=3, label=f"all layers, budget {budget:g}")
            axes[2, col].plot(x, g["worst_layer_coverage"], ":s", ms=3, label=f"worst layer, budget {budget:g}")
            for ax in axes[:, col]:
                ax.set_xticks(x, [str(v) for v in g["value"]])
        axes[0, col].set_title(knob)
        axes[2, col].set_xlabel(knob)
        axes[1, col].axhline(0, color="black", lw=0.6)
        axes[2, col].axhline(1 - DELTA, color="black", lw=0.6, ls="--")
    axes[0, 0].set_ylabel("accuracy (%)")
    axes[1, 0].set_ylabel("paired difference (points)")
    axes[2, 0].set_ylabel("coverage of sqrt(trV/0.05)")
    for ax in axes[:, -1]:
        ax.legend(fontsize=6)
    fig.suptitle("Exploratory: sensitivity to one knob at a time (SnapKV score)")
    fig.tight_layout()
    save_figure(fig, png, pdf)


def main(cells: dict, knobs: dict, baseline: str, table_path: Path, png: Path, pdf: Path) -> None:
    rows = []
    for knob, values in knobs.items():
        for order, (value, variant) in enumerate(values.items()):
            variant = baseline if variant == "baseline" else variant
            for row in summarize(variant, knob, value, cells[variant]):
                rows.append({**row, "order": order})
    table = pd.DataFrame(rows)
    figure(table, knobs, png, pdf)
    write_text_atomic(table[COLUMNS].round(6).to_csv(index=False), table_path)


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(dict(sm.params.cells), dict(sm.params.knobs), sm.params.baseline, Path(sm.output.table),
         Path(sm.output.png), Path(sm.output.pdf))

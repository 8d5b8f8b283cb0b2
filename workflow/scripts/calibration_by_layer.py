"""Per-layer calibration of the certificate (rule ``calibration_by_layer``): a table and a figure.

Reads every cell's ``steps.parquet`` (and the model's name from its ``items.parquet``), and writes
``by_layer.csv``: per model × setting × policy × design × budget × layer, the coverage of ε̂ = √(tr V̂/δ)
with a 95% Wilson interval, Wald coverage, median relative width and Spearman with the true error
(``kvcert.calibration.by_layer``; the calibrated certificate's columns too where the cells carry it); and
the figure of coverage per layer, one panel per setting and budget, one line per model and policy.

The rule runs it through Snakemake's ``script:`` directive (the cell list is the rule's params); by hand:

    python workflow/scripts/calibration_by_layer.py --cells DIR [DIR ...] --table by_layer.csv --figure fig.png
"""

# No `from __future__` import: Snakemake's `script:` puts its own preamble first.
import argparse
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: figures are files
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvcert.analysis.figures import save_figure  # noqa: E402
from kvcert.atomic import atomic_output  # noqa: E402
from kvcert.calibration import BY_LAYER_KEYS, by_layer  # noqa: E402

COLUMNS = BY_LAYER_KEYS + ["n_rows", "n_items", "coverage", "coverage_low", "coverage_high", "uncovered_at_rounding",
                           "wald_coverage", "median_rel_width", "spearman"]


def read_cells(cells: list[str]) -> pd.DataFrame:
    frames = []
    for cell in map(Path, cells):
        steps = pd.read_parquet(cell / "steps.parquet")
        models = pd.read_parquet(cell / "items.parquet", columns=["model"])["model"].astype(str).unique()
        if len(models) != 1:
            raise SystemExit(f"calibration_by_layer: error: {cell / 'items.parquet'}: expected one model, found "
                             f"{sorted(models)}")
        frames.append(steps.assign(model=models[0]))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def figure(table: pd.DataFrame, delta: float) -> plt.Figure:
    """Coverage per layer with its Wilson interval; rows of panels are settings, columns budgets."""
    settings = sorted(table["setting"].unique()) if len(table) else []
    budgets = sorted(table["budget"].unique()) if len(table) else []
    fig, axes = plt.subplots(max(1, len(settings)), max(1, len(budgets)), squeeze=False, sharey=True,
                             figsize=(3.2 * max(1, len(budgets)), 2.6 * max(1, len(settings))))
    lines = sorted({(m, p, d) for m, p, d in table[["model", "policy", "design"]].itertuples(index=False)}) if len(table) else []
    colors = {line: plt.get_cmap("tab10")(i % 10) for i, line in enumerate(lines)}
    calibrated = "coverage_calibrated" in table
    for i, setting in enumerate(settings):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            ax.axhline(1 - delta, color="black", linewidth=0.8, linestyle="--")
            panel = table[(table["setting"] == setting) & (table["budget"] == budget)]
            for line in lines:
                rows = panel[(panel["model"] == line[0]) & (panel["policy"] == line[1]) & (panel["design"] == line[2])]
                if rows.empty:
                    continue
                rows = rows.sort_values("layer")
                err = np.vstack([rows["coverage"] - rows["coverage_low"], rows["coverage_high"] - rows["coverage"]])
                err = np.clip(err, 0.0, None)  # the interval holds the estimate; rounding at 1.0 must not say otherwise
                ax.errorbar(rows["layer"], rows["coverage"], yerr=err, color=colors[line], marker="o", markersize=2.5,
                            linewidth=1, capsize=1.5, label=f"{line[0]} {line[1]} ε̂")
                if calibrated and rows["coverage_calibrated"].notna().any():
                    ax.plot(rows["layer"], rows["coverage_calibrated"], color=colors[line], linestyle=":",
                            marker="s", markersize=2, linewidth=1, label=f"{line[0]} {line[1]} calibrated")
            ax.set_title(f"{setting}, budget {budget:g}", fontsize=9)
            ax.set_ylim(0, 1.02)
            if i == len(settings) - 1:
                ax.set_xlabel("layer")
            if j == 0:
                ax.set_ylabel("coverage")
    if lines:
        handles, labels = axes[0][0].get_legend_handles_labels()
        for row in axes:
            for ax in row:
                for h, l in zip(*ax.get_legend_handles_labels()):
                    if l not in labels:
                        handles.append(h)
                        labels.append(l)
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, -0.02))
    title = f"Coverage per layer of ε̂ = √(tr V̂/δ), δ = {delta:g} (solid; bars: 95% Wilson)"
    if calibrated and table["coverage_calibrated"].notna().any():
        title += " and of the calibrated certificate (dotted)"
    fig.suptitle(title + "; dashed: 1 − δ", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 if lines else 0, 1, 1))
    return fig


def write(cells: list[str], table_path: str, png: str, pdf: str | None = None, delta: float = 0.05) -> int:
    """Write the table and the figure (PNG and PDF) of ``cells``; 1 with one error line when a cell lacks a table."""
    for cell in cells:
        for name in ("steps.parquet", "items.parquet"):
            if not (Path(cell) / name).is_file():
                print(f"calibration_by_layer: error: {Path(cell) / name}: missing", file=sys.stderr)
                return 1
    table = by_layer(read_cells(cells))
    if table.empty:
        table = pd.DataFrame(columns=COLUMNS)
    with atomic_output(table_path) as tmp:
        table.to_csv(tmp, index=False, float_format="%.6g")
    save_figure(figure(table, delta), png, pdf)
    print(f"calibration_by_layer: {len(table)} rows -> {table_path}, {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--figure", required=True, help="PNG path; the PDF is written beside it")
    parser.add_argument("--delta", type=float, default=0.05)
    args = parser.parse_args(argv)
    return write(args.cells, args.table, args.figure, delta=args.delta)


if __name__ == "__main__":
    if "snakemake" in globals():  # rule calibration_by_layer (script directive): its messages go to the rule's log
        sm = snakemake  # noqa: F821
        with open(sm.log[0], "w") as log, redirect_stdout(log), redirect_stderr(log):
            status = write(list(sm.params.cells), sm.output.table, sm.output.png, sm.output.pdf)
        raise SystemExit(status)
    raise SystemExit(main())

"""The calibration study: what each calibrated certificate buys and costs, layer by layer, on held-out prompts.

Reads the step tables of oracle cells (``kvcert-run ... oracle=true``; a cell's ``steps.parquet`` or, for a
cell still running, its ``.parts`` checkpoints), splits the items into K folds and, for every fold, fits each
conformal variant on the other folds' items (``kvcert.calibration.fit_calibration``) and applies it to the
fold's items, so that every item is evaluated by factors fitted without it (cross-fitting). The data-free
design-based certificate needs no fitting. Per model × setting × policy × budget × method it reports
coverage overall and in the worst layer, the number of layers below the target, the median certificate over
the paper's, and Spearman with the true error pooled over layers (and per layer, averaged); per layer, the
coverage of every method.

    python benchmarks/calibration_study.py --cells DIR [DIR ...] --model smollm2 --out-dir results/calibration
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.atomic import atomic_output
from kvcert.calibration import ROUNDING, calibrated_certificate, design_factor, fit_calibration, output_norm, spearman

TARGET = 0.94  # the per-layer coverage the calibrated certificate should reach
DELTA = 0.05
KEYS = ["setting", "policy", "budget"]


# The conformal levels the study traces (the grid the default level was chosen from, docs/CALIBRATION-LEVEL.md),
# and those it also serves never below the paper's certificate.
LEVELS = (0.9, 0.95, 0.975, 0.99)
FLOOR_LEVELS = (0.95, 0.975, 0.99)
DEFAULT = "conformal 0.99"  # the shipped default: kvcert.calibration.default_level(0.05), unit=row, relative term


def read_steps(cells: list[str]) -> pd.DataFrame:
    """Step rows with a certificate and a true error from finished or running cells (``cell``: its index)."""
    frames = []
    for i, cell in enumerate(map(Path, cells)):
        files = [cell / "steps.parquet"] if (cell / "steps.parquet").is_file() else sorted(
            (cell / ".parts").glob("*.steps.parquet"))
        frames += [pd.read_parquet(f).assign(cell=i) for f in files]
    steps = pd.concat(frames, ignore_index=True)
    steps = steps[np.isfinite(steps["cert"]) & np.isfinite(steps["true_err"])].reset_index(drop=True)
    return steps


def methods(has_tail_ess: bool) -> dict[str, dict | None]:
    """name -> fit options (None: no fitting). "conformal L": the family (per-layer base ε̂ + τ‖ô‖, row unit) at
    level L, whose levels 0.9-0.99 trace the trade-off curve; "≥ ε̂": the same, never below ε̂ on any row (the
    default since the third confirmation, docs/CALIBRATION-LEVEL.md); "× ε̂" variants scale ε̂ alone."""
    out: dict[str, dict | None] = {"paper": None}
    if has_tail_ess:
        out["design z=1"] = None
        out["design z=2"] = None
    for level in LEVELS:
        out[f"conformal {level:g}"] = {"level": level}
    for level in FLOOR_LEVELS:
        out[f"conformal {level:g} ≥ ε̂"] = {"level": level, "never_below_paper": True}
    for level in (0.95, 0.975):
        out[f"conformal {level:g} × ε̂"] = {"level": level, "relative_term": False}
    out["conformal 0.95 prompt unit"] = {"level": 0.95, "unit": "prompt"}
    out["conformal 0.975 pooled budgets"] = {"level": 0.975, "pool": True}
    if has_tail_ess:
        out["conformal 0.975 on design"] = {"level": 0.975, "base": "design"}
    return out


def cross_fit(steps: pd.DataFrame, folds: int, options: dict) -> np.ndarray:
    """Calibrated certificate of every row, fitted on the other folds' items."""
    items = np.array(sorted(steps["item_id"].unique()))
    fold_of = {item: i % folds for i, item in enumerate(items)}
    fold = steps["item_id"].map(fold_of).to_numpy()
    n_layers = int(steps["layer"].max()) + 1
    out = np.full(len(steps), np.nan)
    pool = options.get("pool", False)
    fit_rows = steps.assign(budget=0.0) if pool else steps
    for k in range(folds):
        train, test = fold != k, fold == k
        cal = fit_calibration(fit_rows[train], model={"num_layers": n_layers}, design={"delta": DELTA},
                              level=options["level"], unit=options.get("unit", "row"),
                              base=options.get("base", "paper"), relative_term=options.get("relative_term", True),
                              never_below_paper=options.get("never_below_paper", False))
        held = fit_rows[test]
        for key, index in held.groupby(["setting", "policy", "design", "budget"]).indices.items():
            rows = held.iloc[index]
            out[np.flatnonzero(test)[index]] = calibrated_certificate(
                cal, rows, setting=key[0], policy=key[1], design=key[2], budget=key[3])
    return out


def summarize(steps: pd.DataFrame, certs: dict[str, np.ndarray], model: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per model × setting × policy × budget × method. A row whose error is float32 rounding (≤ ROUNDING ‖ô‖,
    where ε̂ = 0 because nothing in the layer's view was evicted) counts as covered for every method."""
    summary, layers = [], []
    err = steps["true_err"].to_numpy(float)
    rounding = err <= ROUNDING * output_norm(steps)
    paper = certs["paper"]
    for key, index in steps.groupby(KEYS).indices.items():
        layer = steps["layer"].to_numpy()[index]
        e, p = err[index], paper[index]
        rho_paper = spearman(p, e)
        for name, cert in certs.items():
            c = cert[index]
            covered = (e <= c) | rounding[index]
            per_layer = pd.Series(covered).groupby(layer).mean()
            within = [rho for rho in (spearman(c[layer == l], e[layer == l]) for l in np.unique(layer))
                      if not np.isnan(rho)]
            summary.append({
                "model": model, **dict(zip(KEYS, key)), "method": name, "n_items": steps["item_id"].iloc[index].nunique(),
                "n_rows": len(index), "coverage": covered.mean(), "worst_layer": int(per_layer.idxmin()),
                "worst_layer_coverage": per_layer.min(), "layers_below_target": int((per_layer < TARGET).sum()),
                "n_layers": len(per_layer), "rounding_rows": int(rounding[index].sum()),
                "median_width_ratio": np.median(c) / np.median(p),
                "spearman": spearman(c, e), "spearman_paper": rho_paper,
                "spearman_within_layer_mean": float(np.mean(within)) if within else np.nan,
            })
            layers += [{"model": model, **dict(zip(KEYS, key)), "method": name, "layer": int(l), "coverage": v}
                       for l, v in per_layer.items()]
    return pd.DataFrame(summary), pd.DataFrame(layers)


README_METHODS = {"paper": "ε̂ (paper)", "design z=2": "design-based", "conformal 0.975 × ε̂": "conformal × ε̂, 0.975",
                  "conformal 0.95": "conformal, 0.95", "conformal 0.975": "conformal, 0.975",
                  "conformal 0.99": "conformal, 0.99 (may narrow ε̂)", "conformal 0.99 ≥ ε̂": "conformal, 0.99, ≥ ε̂ (default)"}


def markdown(summary: pd.DataFrame) -> str:
    """The README's trade-off table: per model, setting and π, each certificate's worst layer per budget, the
    layers below the target, and ranges over budgets of the median width (× the paper's) and pooled Spearman."""
    lines = ["| model | setting | π | certificate | worst layer at 0.1 / 0.25 / 0.5 / 0.75 | layers < 0.94 | "
             "median width × ε̂ | Spearman, pooled (ε̂: ) |", "|---|---|---|---|---|---|---|---|"]
    for (model, setting, policy), group in summary.groupby(["model", "setting", "policy"], sort=False):
        for method, label in README_METHODS.items():
            rows = group[group["method"] == method].sort_values("budget")
            if rows.empty:
                continue
            worst = " / ".join(f"{v:.2f}" for v in rows["worst_layer_coverage"])
            below = " / ".join(str(int(v)) for v in rows["layers_below_target"])
            width = f"{rows['median_width_ratio'].min():.2f}–{rows['median_width_ratio'].max():.2f}"
            rho = f"{rows['spearman'].min():.2f}–{rows['spearman'].max():.2f}"
            flat = "flat (uniform)" if policy == "uniform" else policy
            lines.append(f"| {model} | {setting} | {flat} | {label} | {worst} | {below} | {width} | {rho} |")
    return "\n".join(lines).replace("Spearman, pooled (ε̂: )", "Spearman, pooled")


def tradeoff_figure(summary: pd.DataFrame, path: Path) -> None:
    """Worst-layer coverage against median width (× ε̂) for every certificate, one panel per model and π;
    conformal levels joined into a curve."""
    import matplotlib.pyplot as plt

    from kvcert.analysis.figures import save_figure  # selects the headless backend

    panels = list(summary.groupby(["model", "policy"], sort=True).groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (model, policy) in zip(axes[0], panels):
        group = summary[(summary["model"] == model) & (summary["policy"] == policy)]
        for (setting, budget), rows in group.groupby(["setting", "budget"]):
            label = f"{setting} {budget:g}"
            curve = rows[rows["method"].str.fullmatch(r"conformal [0-9.]+")].sort_values("median_width_ratio")
            line, = ax.plot(curve["median_width_ratio"], curve["worst_layer_coverage"], marker="o", markersize=3,
                            linewidth=1, label=label)
            for method, marker in (("paper", "x"), ("design z=2", "^"), ("conformal 0.99 ≥ ε̂", "*")):
                point = rows[rows["method"] == method]
                ax.plot(point["median_width_ratio"], point["worst_layer_coverage"], marker=marker, linestyle="none",
                        color=line.get_color())
        ax.axhline(TARGET, color="black", linestyle="--", linewidth=0.8)
        ax.axvline(1.5, color="0.5", linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("median width / median ε̂")
        ax.set_ylabel("coverage of the worst layer")
        ax.set_title(f"{model}, π from {policy}", fontsize=9)
        ax.legend(fontsize=6, loc="lower right")
    fig.suptitle("Held-out worst-layer coverage vs width: conformal levels 0.9-0.99 (lines), the default "
                 "(0.99, never below ε̂: *), ε̂ (x), design-based (^)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def combine(out_dir: Path) -> None:
    """The README's table and trade-off figure from every ``study-<model>.csv`` in ``out_dir``."""
    frames = [pd.read_csv(p) for p in sorted(out_dir.glob("study-*.csv")) if not p.stem.endswith("by-layer")]
    summary = pd.concat(frames, ignore_index=True)
    with atomic_output(out_dir / "tradeoff.md") as tmp:
        tmp.write_text(markdown(summary) + "\n")
    tradeoff_figure(summary, out_dir / "tradeoff.png")


def write_cells(steps: pd.DataFrame, calibrated: np.ndarray, cells: list[str], root: Path) -> None:
    """Each input cell's oracle rows with the cross-fitted calibrated certificate, as a cell directory."""
    import shutil

    from kvcert.atomic import write_parquet_atomic

    for i, cell in enumerate(map(Path, cells)):
        mine = (steps["cell"] == i).to_numpy()
        rows = steps[mine].drop(columns="cell").assign(cert_calibrated=calibrated[mine])
        rows["coverage_calibrated"] = (rows["true_err"] <= rows["cert_calibrated"]).astype("float32")
        target = root / cell.name
        target.mkdir(parents=True, exist_ok=True)
        write_parquet_atomic(rows, target / "steps.parquet")
        shutil.copyfile(cell / "items.parquet", target / "items.parquet")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+")
    parser.add_argument("--model", help="label of the model in the tables")
    parser.add_argument("--write-cells", metavar="DIR",
                        help="also write each cell's steps with the default certificate's cross-fitted cert_calibrated "
                             "and coverage_calibrated (and its items) to DIR/<cell>, for the per-layer figure")
    parser.add_argument("--combine", action="store_true",
                        help="only combine the study-*.csv in --out-dir into tradeoff.md and tradeoff.png")
    parser.add_argument("--folds", type=int, default=0, help="folds over items (0: as many as leave 20 items to fit)")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    if args.combine:
        combine(Path(args.out_dir))
        return 0
    if not args.cells or not args.model:
        parser.error("--cells and --model are required (or --combine)")

    steps = read_steps(args.cells)
    n_items = steps.groupby(["setting"])["item_id"].nunique().min()
    folds = args.folds or max(2, -(-int(n_items) // max(1, int(n_items) - 20)))
    has_tail = "tail_ess" in steps and steps["tail_ess"].notna().any()
    certs = {}
    for name, options in methods(has_tail).items():
        if name == "paper":
            certs[name] = steps["cert"].to_numpy(float)
        elif name.startswith("design"):
            z = float(name.split("=")[1])
            certs[name] = steps["cert"].to_numpy(float) * design_factor(steps["tail_ess"].to_numpy(float), z)
        else:
            try:
                certs[name] = cross_fit(steps, folds, options)
            except ValueError as err:  # e.g. too few prompts for the prompt-exchangeable quantile
                print(f"{name}: skipped ({err})")
    summary, layers = summarize(steps, certs, args.model)
    out = Path(args.out_dir)
    if args.write_cells:
        write_cells(steps, certs[DEFAULT], args.cells, Path(args.write_cells))
    for frame, name in ((summary, f"study-{args.model}.csv"), (layers, f"study-{args.model}-by-layer.csv")):
        with atomic_output(out / name) as tmp:
            frame.to_csv(tmp, index=False, float_format="%.4g")
    print(f"{n_items} items per setting, {folds} folds")
    view = summary[["setting", "policy", "budget", "method", "coverage", "worst_layer_coverage", "layers_below_target",
                    "median_width_ratio", "spearman", "spearman_paper"]]
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(view.round(3).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

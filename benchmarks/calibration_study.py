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
from scipy.stats import spearmanr

from kvcert.atomic import atomic_output
from kvcert.calibration import calibrated_certificate, design_factor, fit_calibration

TARGET = 0.94  # the per-layer coverage the calibrated certificate should reach
DELTA = 0.05
KEYS = ["setting", "policy", "budget"]


def read_steps(cells: list[str]) -> pd.DataFrame:
    """Step rows with a certificate and a true error from finished or running cells."""
    frames = []
    for cell in map(Path, cells):
        files = [cell / "steps.parquet"] if (cell / "steps.parquet").is_file() else sorted(
            (cell / ".parts").glob("*.steps.parquet"))
        frames += [pd.read_parquet(f) for f in files]
    steps = pd.concat(frames, ignore_index=True)
    steps = steps[np.isfinite(steps["cert"]) & np.isfinite(steps["true_err"])].reset_index(drop=True)
    return steps


def methods(has_tail_ess: bool) -> dict[str, dict | None]:
    """name -> fit options (None: no fitting). Levels 0.9-0.99 trace the conformal trade-off curve."""
    out: dict[str, dict | None] = {"paper": None}
    if has_tail_ess:
        out["design z=1"] = None
        out["design z=2"] = None
    for level in (0.9, 0.95, 0.975, 0.99):
        out[f"conformal row {level:g}"] = {"level": level, "unit": "row", "base": "paper"}
    out["conformal prompt 0.95"] = {"level": 0.95, "unit": "prompt", "base": "paper"}
    out["conformal row 0.95 pooled budgets"] = {"level": 0.95, "unit": "row", "base": "paper", "pool": True}
    if has_tail_ess:
        out["conformal row 0.95 on design"] = {"level": 0.95, "unit": "row", "base": "design"}
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
                              level=options["level"], unit=options["unit"], base=options["base"])
        held = fit_rows[test]
        for key, index in held.groupby(["setting", "policy", "design", "budget"]).indices.items():
            rows = held.iloc[index]
            out[np.flatnonzero(test)[index]] = calibrated_certificate(
                cal, rows, setting=key[0], policy=key[1], design=key[2], budget=key[3])
    return out


def summarize(steps: pd.DataFrame, certs: dict[str, np.ndarray], model: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    summary, layers = [], []
    err = steps["true_err"].to_numpy(float)
    paper = certs["paper"]
    for key, index in steps.groupby(KEYS).indices.items():
        layer = steps["layer"].to_numpy()[index]
        e, p = err[index], paper[index]
        rho_paper = spearmanr(p, e).statistic
        for name, cert in certs.items():
            c = cert[index]
            covered = e <= c
            per_layer = pd.Series(covered).groupby(layer).mean()
            within = [spearmanr(c[layer == l], e[layer == l]).statistic for l in np.unique(layer)
                      if np.ptp(c[layer == l]) > 0 and np.ptp(e[layer == l]) > 0]
            summary.append({
                "model": model, **dict(zip(KEYS, key)), "method": name, "n_items": steps["item_id"].iloc[index].nunique(),
                "n_rows": len(index), "coverage": covered.mean(), "worst_layer": int(per_layer.idxmin()),
                "worst_layer_coverage": per_layer.min(), "layers_below_target": int((per_layer < TARGET).sum()),
                "n_layers": len(per_layer), "median_width_ratio": np.median(c) / np.median(p),
                "spearman": spearmanr(c, e).statistic, "spearman_paper": rho_paper,
                "spearman_within_layer_mean": float(np.mean(within)) if within else np.nan,
            })
            layers += [{"model": model, **dict(zip(KEYS, key)), "method": name, "layer": int(l), "coverage": v}
                       for l, v in per_layer.items()]
    return pd.DataFrame(summary), pd.DataFrame(layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", required=True)
    parser.add_argument("--model", required=True, help="label of the model in the tables")
    parser.add_argument("--folds", type=int, default=0, help="folds over items (0: as many as leave 20 items to fit)")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)

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

"""One figure per claim, drawn from the numbers the claim analysis computed (``figure_data``).

Registry ``FIGURES`` maps a claim id to its drawing function; ``save`` writes a claim's figure through
``save_figure``, the project's one way to write a figure: PNG and PDF, atomically (temporary file, then
rename: an interrupted run leaves no half-written figure) and byte-reproducibly. The workflow's other
figures (per-layer calibration, sensitivity) and the calibration benchmark call it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # headless: figures are files, never windows
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvcert.analysis.claims import ClaimResult  # noqa: E402
from kvcert.atomic import atomic_output  # noqa: E402

SIGNAL_STYLE = {
    "certificate": {"color": "tab:blue", "label": "certificate (cert_mean)"},
    "certificate_max": {"color": "tab:cyan", "label": "certificate (cert_max)", "linestyle": ":"},
    "confidence": {"color": "tab:orange", "label": "confidence (low log-prob)"},
    "random": {"color": "0.4", "label": "random", "linestyle": "--"},
}


def _budget(result: ClaimResult):
    """C1/C2: accuracy vs budget for each (policy, design); the full cache as a line."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    table = result.figure_data["table"]
    lines: dict[tuple, list] = {}
    for row in table:
        lines.setdefault((row["policy"], row["design"]), []).append((row["budget"], row["accuracy"]))
    for (policy, design), pts in sorted(lines.items()):
        pts.sort()
        if policy == "full":
            ax.axhline(pts[0][1], color="black", linestyle="--", linewidth=1, label="full cache")
            continue
        x, y = zip(*pts)
        ax.plot(x, y, marker="o" if design == "poisson" else "s",
                linestyle="-" if design == "poisson" else "--", label=f"{policy} / {design}")
    ax.set_xlabel("budget (fraction of context kept)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{result.claim.upper()}: accuracy vs budget ({result.figure_data['setting']})")
    ax.legend(fontsize=7)
    return fig


def _coverage(result: ClaimResult):
    """C3: calibration of sqrt(trV/delta) over a delta grid, and certificate vs true error."""
    fd = result.figure_data
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    nominal = 1 - np.asarray(fd["calibration"]["delta"])
    for budget, cov in fd["calibration"]["coverage"].items():
        left.plot(nominal, cov, marker="o", label=f"budget {budget}")
    left.plot([nominal.min(), 1], [nominal.min(), 1], color="black", linestyle="--", linewidth=1, label="nominal")
    left.set_xlabel("nominal coverage 1 - delta")
    left.set_ylabel("empirical coverage of sqrt(trV / delta)")
    left.legend(fontsize=7)
    cert, err, budgets = np.asarray(fd["cert"]), np.asarray(fd["true_err"]), np.asarray(fd["budget"])
    ok = (cert > 0) & (err > 0)
    for b in np.unique(budgets):
        m = ok & (budgets == b)
        right.scatter(cert[m], err[m], s=3, alpha=0.4, label=f"budget {b:g}")
    if ok.any():
        lo, hi = min(cert[ok].min(), err[ok].min()), max(cert[ok].max(), err[ok].max())
        right.plot([lo, hi], [lo, hi], color="black", linestyle="--", linewidth=1, label="error = certificate")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel(f"certificate sqrt(trV / {fd['delta']:g})")
    right.set_ylabel("true error ||o_hat - o||")
    right.legend(fontsize=7, markerscale=3)
    fig.suptitle("C3: certificate coverage")
    fig.tight_layout()
    return fig


def _roc(result: ClaimResult):
    """C4/C6: ROC curves of the certificate and the confidence."""
    fd = result.figure_data
    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    for signal, curve in fd["roc"].items():
        style = SIGNAL_STYLE.get(signal, {"label": signal})
        auc = result.details.get(f"auc_{signal}", {}).get("estimate")
        label = style["label"] + (f", AUC {auc:.3f}" if auc is not None and np.isfinite(auc) else "")
        ax.plot(curve["fpr"], curve["tpr"], **{**style, "label": label})
    ax.plot([0, 1], [0, 1], color="black", linewidth=0.8, linestyle=":")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel(f"true positive rate ({fd['positive']})")
    ax.set_title(f"{result.claim.upper()}: {fd['title']}")
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _curve(result: ClaimResult):
    """C5/C7: replayed accuracy vs intervention rate for each gating signal."""
    fd = result.figure_data
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    rate = fd["curve"]["rate"]
    for signal in ("certificate", "confidence", "random"):
        ax.plot(rate, fd["curve"][signal], **SIGNAL_STYLE[signal])
    ax.axvline(fd["rate"], color="black", linewidth=0.8, linestyle=":", label=f"pre-registered rate {fd['rate']:g}")
    ax.set_xlabel(fd["xlabel"])
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{result.claim.upper()}: {fd['title']}")
    ax.legend(fontsize=7)
    return fig


SHARE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def _by_configuration(result: ClaimResult):
    """C2 / C3 decided per configuration (``details.scope``): scorers (and allocators) in rows; C2's budgets, or
    C3's coverage and Spearman, in columns; each certain-head share one interval, the threshold a line."""
    details = result.details
    configs, components = details["configurations"], details["components"]
    column_of = (lambda name, key: f"budget {key['budget']}") if result.claim == "c2" else \
        (lambda name, key: name.split("[")[0])
    rows = sorted({(k["policy"], k["allocator"]) for k in configs.values()},
                  key=lambda r: (r[1] != "uniform", r[1], r[0]))
    columns = sorted({column_of(c["name"], configs[c["name"]]) for c in components})
    shares = sorted({configs[c["name"]]["head_fraction"] for c in components}, key=float)
    fig, axes = plt.subplots(1, len(columns), figsize=(3.6 * len(columns), 0.9 + 0.32 * len(rows)), sharey=True,
                             squeeze=False)
    offset = {h: (i - (len(shares) - 1) / 2) * 0.22 for i, h in enumerate(shares)}
    for ax, column in zip(axes[0], columns):
        for c in components:
            key = configs[c["name"]]
            if column_of(c["name"], key) != column:
                continue
            y = rows.index((key["policy"], key["allocator"])) + offset[key["head_fraction"]]
            est, lo, hi = (np.nan if c.get(k) is None else float(c[k]) for k in ("estimate", "ci_low", "ci_high"))
            color = SHARE_COLORS[shares.index(key["head_fraction"]) % len(SHARE_COLORS)]
            ax.errorbar([est], [y], xerr=[[max(est - lo, 0.0)], [max(hi - est, 0.0)]], fmt="o", markersize=3,
                        color=color, elinewidth=1, capsize=2)
            if c.get("threshold") is not None:
                ax.axvline(float(c["threshold"]), color="black", linewidth=0.8, linestyle=":")
        ax.set_title(column, fontsize=9)
        ax.set_xlabel("Poisson+Hajek minus top-k (points)" if result.claim == "c2" else column, fontsize=8)
    axes[0][0].set_yticks(range(len(rows)))
    axes[0][0].set_yticklabels([p if a == "uniform" else f"{p} / {a}" for p, a in rows], fontsize=8)
    axes[0][0].set_ylim(len(rows) - 0.5, -0.5)  # first row on top, half a row of margin
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=SHARE_COLORS[i % len(SHARE_COLORS)],
                          label=f"certain-head share {h}") for i, h in enumerate(shares)]
    handles.append(plt.Line2D([], [], color="black", linestyle=":", label="pre-registered threshold"))
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=len(handles), bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(f"{result.claim.upper()} per scorer, allocator and certain-head share (95% intervals)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def draw(result: ClaimResult) -> "plt.Figure":
    """The claim's figure: per configuration where the claim was decided so, else the claim's own drawing."""
    if result.details.get("scope") == "per_configuration":
        return _by_configuration(result)
    return FIGURES[result.claim](result)


# No creation date or software string in the files: the same data give the same bytes on every run.
REPRODUCIBLE = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None, "Creator": None}}

FIGURES: dict[str, Callable[[ClaimResult], "plt.Figure"]] = {
    "c1": _budget, "c2": _budget, "c3": _coverage, "c4": _roc, "c5": _curve, "c6": _roc, "c7": _curve,
}


def save_figure(fig: "plt.Figure", png: str | Path, pdf: str | Path | None = None) -> list[Path]:
    """Write ``fig`` to ``png`` and to ``pdf`` (default: ``png`` with suffix .pdf), each atomically and
    byte-reproducibly, then close it (also on error). Returns the two paths written."""
    png = Path(png)
    targets = ((png, "png"), (Path(pdf) if pdf is not None else png.with_suffix(".pdf"), "pdf"))
    try:
        for target, ext in targets:
            with atomic_output(target) as tmp:
                fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight", metadata=REPRODUCIBLE[ext])
    finally:
        plt.close(fig)
    return [target for target, _ in targets]


def save(result: ClaimResult, figure_dir: str | Path) -> list[Path]:
    """Draw the claim's figure and write ``<figure_dir>/<claim>.png`` and ``.pdf`` (``save_figure``)."""
    figure_dir = Path(figure_dir)
    figure_dir.mkdir(parents=True, exist_ok=True)
    return save_figure(draw(result), figure_dir / f"{result.claim}.png")

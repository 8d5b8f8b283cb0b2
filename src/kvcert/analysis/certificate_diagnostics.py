"""Post-verdict diagnostics of an exploratory certified-budgets study (EXPLORATORY: added after its held-out checks
1 to 3 were read; no check or claim reads them). Executed by the notebook workflow/notebooks/certified_diagnostics.py.ipynb
(rule ``notebook_certified_diagnostics``), on the frames kvcert.analysis.certified reads (steps with_bounds):

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
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from kvcert.analysis.certified import HEAD_KEYS, KEYS, levels as _levels, met as _met
from kvcert.analysis.stats import auc

FLAG_COLUMNS = ["model", "configuration", "sizing", "family", "epsilon", "layer", "n_step_rows", "above_low",
                "above_high", "flagged", "caught", "silent_low", "silent_high", "n_met_step_rows", "met_flagged",
                "level"]


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


def flags_figure(flags: pd.DataFrame, delta: float):
    """Per model (columns): the decode rows possibly above ε (x) against those of them the certificate left
    unflagged (y), one point per configuration and ε over every layer (``certificate_flags``' rows with ``layer`` =
    all; a target as a star); y = x is a certificate that flags nothing, y = δ (dotted) what a certificate at level
    δ allows. Returns the matplotlib Figure (the notebook shows it; rule certificate_flags_figure writes it)."""
    import matplotlib.pyplot as plt

    overall = flags[flags["layer"].astype(str) == "all"]
    models = list(dict.fromkeys(overall["model"]))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(4.8 * max(1, len(models)), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        m = overall[overall["model"] == model]
        for family, g in m.groupby("family", sort=False):
            ax.plot(g["above_high"], g["silent_high"], marker="*" if g["sizing"].iloc[0] == "target" else "o",
                    ls="none", label=family, alpha=0.85)
        ax.axline((0, 0), slope=1, color="0.5", lw=0.8, ls="-.")
        ax.axhline(delta, color="black", lw=0.8, ls=":")
        ax.set_xlim(left=0)
        ax.set_ylim(0, max(1.5 * delta, 1.2 * float(m["silent_high"].max())) if len(m) else 1.5 * delta)
        ax.set_title(model)
        ax.set_xlabel("decode rows possibly above eps")
    axes[0, 0].set_ylabel("rows above eps, certificate silent")
    axes[0, -1].legend(fontsize=7, frameon=False)
    fig.suptitle("Exploratory: what the certificate flagged")
    fig.tight_layout()
    return fig

"""Held-out checks of an exploratory study, decided from a locked spec (``preregistration/exploratory/<scale>.yaml``).

A held-out check runs a study's configurations on fresh data and compares each with the study's row of the same
model and configuration (the reference). Its criteria are a spec, locked by ``kvcert-prereg lock --exploratory
<scale>`` (the lock lists the sha256 of the spec, of this module and of the modules whose rule it applies), and
decided here through :func:`kvcert.analysis.verdicts.decide`, the claims' rule, each comparison one component:

* ``criterion: point`` (checks 2 and 3 of the certified-budgets study, transcribed from their scales' comments):
  per target row, ``kept_less`` (the fixed budget's kept fraction minus the target's, greater than 0),
  ``accuracy_kept`` (the target's accuracy minus the fixed budget's, greater than ``-tolerance``: at least it)
  and ``coverage_gap`` (the largest absolute difference of either end of the coverage bracket from the reference's,
  less than ``margin + tolerance``). The comparisons have no interval: each is a point estimate (an interval of
  zero width), so a component is supported or not, never inconclusive. memory = kept_less and accuracy_kept;
  holds = all three (verdicts.combine).
* ``future``, for checks not yet run (issue 59.3): coverage one-sided (the check's certainly-covered share at
  least the reference's minus ``coverage_margin``: higher coverage never fails) and accuracy by a paired
  non-inferiority rule on items (the exact one-sided ``1 - alpha`` upper bound of the fixed budget's accuracy minus
  the target's, from the discordant items, below ``accuracy_margin`` points), with the item count
  :func:`noninferiority_items` sizes in advance.

Tables are pandas frames; no Snakemake and no file layout here beyond reading the spec and its lock.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy.stats import beta, norm

from kvcert.analysis.errors import AnalysisError, PreregistrationError
from kvcert.analysis.stats import Interval
from kvcert.analysis.verdicts import SUPPORTED, Component, combine, decide
from kvcert.atomic import write_text_atomic

SPEC_DIR = "preregistration/exploratory"
# What an exploratory spec's lock freezes beside the spec: this module and the rule it applies.
DECIDING_MODULES = ("src/kvcert/analysis/heldout.py", "src/kvcert/analysis/verdicts.py",
                    "src/kvcert/analysis/stats.py")
SPEC_KEYS = ("scale", "written", "transcribed_from", "against", "fixed", "criterion", "margin", "tolerance",
             "reported_beside", "future")
FUTURE_KEYS = ("coverage_margin", "accuracy_margin", "alpha", "power", "discordance", "n_items")
CHECK_COLUMNS = ["model", "configuration", "target_error", "kept_fraction", "accuracy", "fixed", "fixed_kept_fraction",
                 "fixed_accuracy", "memory_holds", "coverage_low", "coverage_high", "study_coverage_low",
                 "study_coverage_high", "coverage_gap", "coverage_holds", "holds", "full_accuracy", "other_fixed",
                 "other_fixed_accuracy"]
DECISION_COLUMNS = ["decision", "configurations", "models", "n_rows", "n_holding", "holds"]


@dataclass(frozen=True)
class Spec:
    """A held-out check's locked spec: the reference table (``against``), the fixed configuration its memory part
    compares with, the coverage margin and rounding tolerance, the rows reported beside the verdict, the decisions
    (name -> configurations whose rows must all hold) and the rule for future checks."""

    path: str
    scale: str
    against: str
    fixed: str
    margin: float
    tolerance: float
    beside: tuple[str, ...]
    full: str
    decisions: tuple[tuple[str, tuple[str, ...]], ...]
    future: dict


def _number(rel: str, key: str, value, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
        raise AnalysisError(f"{rel}: {key}={value!r}: expected a number in [{low:g}, {high:g})")
    return float(value)


def spec_path(scale: str) -> str:
    """The repository-relative spec of a scale's held-out check."""
    return f"{SPEC_DIR}/{scale}.yaml"


def lock_path(scale: str) -> str:
    return f"{SPEC_DIR}/{scale}.lock"


def load_spec(root: str | Path, scale: str) -> Spec:
    """Parse and check ``preregistration/exploratory/<scale>.yaml``; every error names the file and the key."""
    rel = spec_path(scale)
    path = Path(root) / rel
    if not path.is_file():
        raise AnalysisError(f"{rel}: missing (the held-out check of scale {scale} has no spec)")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise AnalysisError(f"{rel}: not valid YAML ({str(exc).splitlines()[0]})") from None
    missing = [k for k in SPEC_KEYS if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise AnalysisError(f"{rel}: lacks key(s) {', '.join(missing)}")
    if doc["scale"] != scale:
        raise AnalysisError(f"{rel}: scale={doc['scale']!r}, expected {scale!r}")
    if doc["criterion"] != "point":
        raise AnalysisError(f"{rel}: criterion={doc['criterion']!r}: only 'point' (checks already run) is known")
    beside = doc["reported_beside"]
    if not isinstance(beside, dict) or not isinstance(beside.get("fixed"), list) or not isinstance(
            beside.get("full"), str):
        raise AnalysisError(f"{rel}: reported_beside={beside!r}: expected {{fixed: [configurations], full: name}}")
    decisions = doc.get("decisions") or {}
    if not isinstance(decisions, dict) or not all(isinstance(v, list) and v for v in decisions.values()):
        raise AnalysisError(f"{rel}: decisions={decisions!r}: expected {{name: [configurations]}}")
    future = doc["future"]
    if not isinstance(future, dict) or [k for k in FUTURE_KEYS if k not in future]:
        raise AnalysisError(f"{rel}: future lacks key(s) "
                            f"{', '.join(k for k in FUTURE_KEYS if not isinstance(future, dict) or k not in future)}")
    return Spec(path=rel, scale=scale, against=str(doc["against"]), fixed=str(doc["fixed"]),
                margin=_number(rel, "margin", doc["margin"], 0, 1),
                tolerance=_number(rel, "tolerance", doc["tolerance"], 0, 1e-3),
                beside=tuple(map(str, beside["fixed"])), full=beside["full"],
                decisions=tuple((str(k), tuple(map(str, v))) for k, v in decisions.items()), future=dict(future))


# --- the lock ------------------------------------------------------------------------------------------------------


def locked_files(scale: str) -> tuple[str, ...]:
    return (spec_path(scale), *DECIDING_MODULES)


def _sha256(root: Path, rel: str) -> str:
    from kvcert.analysis.prereg import sha256

    path = root / rel
    if not path.is_file():
        raise PreregistrationError(f"{rel} is missing (the exploratory spec's lock freezes it)")
    return sha256(path)


def write_spec_lock(root: str | Path, scale: str, force: bool = False) -> Path:
    """Freeze a held-out check's spec with the code that decides it (refuses to overwrite an existing lock)."""
    root = Path(root)
    load_spec(root, scale)  # never lock a spec that does not parse
    lock = root / lock_path(scale)
    if lock.exists() and not force:
        raise PreregistrationError(f"{lock_path(scale)} already exists: the spec is frozen")
    files = locked_files(scale)
    payload = {"kind": "exploratory", "scale": scale, "algorithm": "sha256",
               "locked_at_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "files": list(files), "sha256": {rel: _sha256(root, rel) for rel in files}}
    write_text_atomic(json.dumps(payload, indent=2) + "\n", lock)
    return lock


def verify_spec_lock(root: str | Path, scale: str) -> dict:
    """Raise PreregistrationError unless the spec's lock exists and every file it freezes is unchanged."""
    root = Path(root)
    rel = lock_path(scale)
    if not (root / rel).is_file():
        raise PreregistrationError(f"{rel} is missing: lock the spec (kvcert-prereg lock --exploratory {scale}) "
                                   "before deciding the check")
    try:
        lock = json.loads((root / rel).read_text())
        files, hashes = list(lock["files"]), dict(lock["sha256"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PreregistrationError(f"{rel} is not a valid lock file ({type(exc).__name__}: {exc})") from None
    if files != list(locked_files(scale)):
        raise PreregistrationError(f"{rel} freezes a different file list than this code "
                                   f"(differs in: {', '.join(sorted(set(files) ^ set(locked_files(scale)))) or 'order'})")
    for f in files:
        new = _sha256(root, f)
        if hashes.get(f, "") != new:
            raise PreregistrationError(f"{f} changed since {rel} (sha256 {new[:12]} != locked "
                                       f"{hashes.get(f, '')[:12]}): the held-out spec is frozen")
    return lock


def locked_scales(root: str | Path) -> list[str]:
    """Every scale with an exploratory spec lock under ``root``."""
    return sorted(p.stem for p in (Path(root) / SPEC_DIR).glob("*.lock"))


# --- the criterion as written (checks 2 and 3) ----------------------------------------------------------------------


def _point(estimate: float) -> Interval:
    """A comparison without an interval: the point itself, zero width."""
    return Interval(float(estimate), float(estimate), float(estimate), 0, 0)


def _row(table: pd.DataFrame, model: str, configuration: str, source: str) -> pd.Series:
    found = table[(table["model"] == model) & (table["configuration"] == configuration)]
    if len(found) != 1:
        raise AnalysisError(f"{source}: {len(found)} rows of model={model} configuration={configuration!r}; "
                            "the check needs exactly one")
    return found.iloc[0]


def target_rows(summary: pd.DataFrame) -> pd.DataFrame:
    """The rows of target configurations: a target error and the design that keeps what the target chose
    (poisson; clt, the decode-time sampler at the same error, keeps the whole cache and is no target row)."""
    return summary[summary["target_error"].notna() & (summary["design"] == "poisson")]


def components(target: pd.Series, fixed: pd.Series, reference: pd.Series, spec: Spec) -> list[Component]:
    """The three components of one target row: kept_less, accuracy_kept, coverage_gap (the module docstring)."""
    eps = float(target["target_error"])
    low, high = f"coverage_low_{eps:g}", f"coverage_high_{eps:g}"
    gap = max(abs(target[low] - reference[low]), abs(target[high] - reference[high]))
    return [decide("kept_less", _point(fixed["kept_fraction"] - target["kept_fraction"]),
                   {"threshold": 0.0, "direction": "greater"}),
            decide("accuracy_kept", _point(target["accuracy"] - fixed["accuracy"]),
                   {"threshold": -spec.tolerance, "direction": "greater"}),
            decide("coverage_gap", _point(gap), {"threshold": spec.margin + spec.tolerance, "direction": "less"})]


def check_table(summary: pd.DataFrame, reference: pd.DataFrame, spec: Spec,
                reference_source: str = "the reference summary.csv") -> pd.DataFrame:
    """check.csv's rows (CHECK_COLUMNS) for every target row of ``summary`` (the check's summary.csv) against the
    row of the same model and configuration of ``reference``; the verdicts by :func:`components`."""
    targets = target_rows(summary)
    if targets.empty:
        raise AnalysisError("the check's summary.csv holds no target configuration")
    rows = []
    for _, t in targets.iterrows():
        model, eps = t["model"], float(t["target_error"])
        base = _row(summary, model, spec.fixed, "the check's summary.csv")
        full = _row(summary, model, spec.full, "the check's summary.csv")
        ref = _row(reference, model, t["configuration"], reference_source)
        kept_less, accuracy_kept, coverage = components(t, base, ref, spec)
        others = summary[(summary["model"] == model) & summary["configuration"].isin(spec.beside)]
        low, high = f"coverage_low_{eps:g}", f"coverage_high_{eps:g}"
        rows.append({"model": model, "configuration": t["configuration"], "target_error": eps,
                     "kept_fraction": t["kept_fraction"], "accuracy": t["accuracy"], "fixed": spec.fixed,
                     "fixed_kept_fraction": base["kept_fraction"], "fixed_accuracy": base["accuracy"],
                     "memory_holds": combine([kept_less, accuracy_kept]) == SUPPORTED,
                     "coverage_low": t[low], "coverage_high": t[high],
                     "study_coverage_low": ref[low], "study_coverage_high": ref[high],
                     "coverage_gap": coverage.estimate, "coverage_holds": coverage.verdict == SUPPORTED,
                     "holds": combine([kept_less, accuracy_kept, coverage]) == SUPPORTED,
                     "full_accuracy": full["accuracy"], "other_fixed": "; ".join(others["configuration"]),
                     "other_fixed_accuracy": "; ".join(f"{a:g}" for a in others["accuracy"])})
    return pd.DataFrame(rows, columns=CHECK_COLUMNS)


def decisions(check: pd.DataFrame, spec: Spec) -> pd.DataFrame:
    """The spec's decisions (DECISION_COLUMNS): each holds where every row of its configurations holds, in every
    model of the check (e.g. check 3's ``floor``: both floored targets of both models)."""
    rows = []
    for name, configurations in spec.decisions:
        chosen = check[check["configuration"].isin(configurations)]
        absent = sorted(set(configurations) - set(chosen["configuration"]))
        if absent:
            raise AnalysisError(f"{spec.path}: decisions.{name} names {', '.join(map(repr, absent))}, not in check.csv")
        rows.append({"decision": name, "configurations": "; ".join(configurations),
                     "models": "; ".join(dict.fromkeys(chosen["model"])), "n_rows": int(len(chosen)),
                     "n_holding": int(chosen["holds"].sum()), "holds": bool(chosen["holds"].all())})
    return pd.DataFrame(rows, columns=DECISION_COLUMNS)


# --- the rule for future checks --------------------------------------------------------------------------------------


def noninferiority_items(discordance: float, margin: float, alpha: float, power: float) -> int:
    """Items a paired non-inferiority check needs: the smallest n at which a one-sided level-``alpha`` test of "the
    fixed budget's accuracy minus the target's is below ``margin``" (shares of the items) has power ``power`` when
    the two are equal and answer differently on a share ``discordance`` of the items. To first order (the
    difference's variance is discordance / n when the two are equal): n = (z(1 − alpha) + z(power))² ·
    discordance / margin²."""
    for name, value, low, high in (("discordance", discordance, 0, 1), ("margin", margin, 0, 1),
                                   ("alpha", alpha, 0, 0.5), ("power", power, 0.5, 1)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and low < value < high):
            raise ValueError(f"{name}={value!r}: must lie in ({low}, {high})")
    return math.ceil((norm.ppf(1 - alpha) + norm.ppf(power)) ** 2 * discordance / margin ** 2)


def future_coverage(coverage_low: float, reference_low: float, future: dict) -> Component:
    """One-sided coverage: the check's certainly-covered share minus the reference's, above -coverage_margin."""
    return decide("coverage_not_lower", _point(coverage_low - reference_low),
                  {"threshold": -float(future["coverage_margin"]), "direction": "greater"})


def future_accuracy(target_correct, fixed_correct, future: dict) -> Component:
    """Paired non-inferiority of accuracy on the same items (target_correct, fixed_correct: (items,) booleans in
    item order). The fixed budget's accuracy minus the target's, in points, is (b − c)/n · 100 with b the items
    only the fixed budget answered right, c the reverse; its one-sided ``1 - alpha`` upper bound is exact given the
    m = b + c discordant items (Clopper-Pearson on b of m, as McNemar's test conditions): m/n · (2 p_u − 1) · 100.
    Supported where that bound lies below ``accuracy_margin`` (points); refused below the item count the spec fixed
    in advance."""
    t = np.asarray(target_correct, dtype=bool)
    f = np.asarray(fixed_correct, dtype=bool)
    if t.shape != f.shape or t.ndim != 1:
        raise AnalysisError(f"paired accuracy: {t.shape} target items against {f.shape} fixed ones: not paired")
    n, alpha = len(t), float(future["alpha"])
    if n < int(future["n_items"]):
        raise AnalysisError(f"paired accuracy: {n} items, fewer than the spec's future.n_items={future['n_items']}")
    b, c = int((f & ~t).sum()), int((t & ~f).sum())
    m = b + c
    upper = 1.0 if b == m else float(beta.ppf(1 - alpha, b + 1, m - b))
    lower = 0.0 if b == 0 else float(beta.ppf(alpha, b, m - b + 1))
    scale = 100.0 * m / n
    interval = Interval(100.0 * (b - c) / n, scale * (2 * lower - 1) if m else 0.0,
                        scale * (2 * upper - 1) if m else 0.0, 0, 0)
    return decide("accuracy_loss", interval, {"threshold": float(future["accuracy_margin"]), "direction": "less"})

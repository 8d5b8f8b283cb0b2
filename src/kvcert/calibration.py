"""Calibrated certificates: beside the paper's ε̂ = √(tr V̂/δ), a certificate meant to hold layer by layer
(docs/METHOD.md §7). Exploratory: the pre-registered certificate of claim C3 stays ε̂, unchanged.

Two corrections, both serving-ready (nothing here needs the oracle once fitted):

* ``conformal`` (the default): per layer, and per setting, policy, design and budget, a base certificate
  b = ε̂ + τ‖ô‖ (τ ≥ 0 picked per layer from ``NORM_WEIGHTS`` on the calibration rows, or b = ‖ô‖ alone
  where ε̂ says nothing) and the split-conformal quantile q of ‖ô − o‖ / b over calibration prompts
  disjoint from the evaluation prompts; the calibrated certificate of a row is q · b. Fitted once per model
  (``kvcert-calibrate``) and stored as a small versioned JSON file bound to the model's identity
  (``model_identity``) and to the design's knobs (``design_knobs``); applying it to another model or to
  other knobs is refused.
* ``design`` (no data): ε̂ · √(1 + z/√n_eff), an inflation by the effective number n_eff of sampled terms
  behind tr V̂ (the ``tail_ess`` column); it needs no file.

``apply_calibration`` adds ``cert_calibrated`` (and, with the oracle, ``coverage_calibrated``) to a
configuration's step rows; ``calibration_summary`` gives their item-level summaries; ``by_layer`` the
per-layer table of coverage, width and rank correlation that the workflow reports.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from . import defaults
from .atomic import write_json_atomic
from .designs import DesignOptions
from .errors import CalibrationError
from .schema import CALIBRATED_ITEM_COLUMNS, CALIBRATED_STEP_COLUMNS

FORMAT = "kvcert-calibration"
VERSION = 1
METHODS = ("conformal", "design")
BASES = ("paper", "design")  # what the conformal factor multiplies: ε̂, or the design-inflated ε̂
UNITS = ("row", "prompt")  # what the conformal quantile treats as exchangeable
DESIGN = "design"  # ``calibration=design``: the data-free correction, no file
DESIGN_Z = 2.0  # the design-based inflation's z (see ``design_factor``)
# τ of the base certificate ε̂ + τ‖ô‖ that a fit tries per layer: 0 keeps ε̂'s shape (where it ranks the error
# well); larger τ lean on ‖ô‖ where ε̂ is near 0 while the error is not (slots the retained set cannot see).
NORM_WEIGHTS = (0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
# A candidate base may rank a layer's calibration errors at most this much worse (Spearman) than ε̂ does.
RANK_TOLERANCE = 0.01
# Float32 rounding: the compressed and the full path differ by up to ~1e-6 ‖ô‖ even where nothing was
# evicted from a layer's view (e.g. a sliding-window layer whose window was kept whole, where ε̂ = 0). A
# calibrated certificate never claims less than this; the per-layer table counts such rows apart.
ROUNDING = 1e-5
STRATUM_KEYS = ("setting", "policy", "design", "budget")
KNOBS = ("n_sink", "n_recent", "head_fraction", "pi_min", "delta", "observation_window", "policy_options")
# Config keys that do not change what a model computes (set by attach, or by where it was loaded from).
_VOLATILE_CONFIG_KEYS = ("_attn_implementation", "_attn_implementation_internal", "_name_or_path", "name_or_path",
                         "transformers_version", "_commit_hash")
_WEIGHT_SAMPLE = 64  # leading and trailing elements of every parameter that the weight hash reads


# --- identities -----------------------------------------------------------------------------------------


def model_identity(model) -> dict[str, Any]:
    """What a calibration is bound to: the loaded model's architecture and weights, in one place.

    config_sha256 hashes the model config (without keys that name where it came from or which attention
    runs); weights_sha256 hashes, for every parameter in order, its name, shape, dtype and its first and last
    64 values (a different checkpoint of the same architecture differs there; hashing everything would cost
    seconds per call). Also records the number of decoder layers and the model type, for messages.
    """
    import torch

    config = model.config.to_dict()
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    config_sha = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            sample = torch.cat([flat[:_WEIGHT_SAMPLE], flat[-_WEIGHT_SAMPLE:]]).to("cpu", torch.float32)
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    text = model.config.get_text_config(decoder=True)
    return {"model_type": str(getattr(text, "model_type", getattr(model.config, "model_type", "?"))),
            "num_layers": int(getattr(text, "num_hidden_layers", 0) or 0),
            "config_sha256": config_sha, "weights_sha256": digest.hexdigest()}


def design_knobs(options: DesignOptions = DesignOptions(), *, delta: float = defaults.DELTA,
                 observation_window: int = defaults.OBSERVATION_WINDOW,
                 policy_options: Mapping | None = None) -> dict[str, Any]:
    """The knobs that decide π and ε̂, and so the calibration factors (``KNOBS``)."""
    return {"n_sink": int(options.n_sink), "n_recent": int(options.n_recent),
            "head_fraction": float(options.head_fraction), "pi_min": float(options.pi_min), "delta": float(delta),
            "observation_window": int(observation_window),
            "policy_options": json.loads(json.dumps(dict(policy_options or {}), sort_keys=True))}


def knob_label(name: str) -> str:
    return f"design_options.{name}" if name in ("n_sink", "n_recent", "head_fraction", "pi_min") else name


# --- the two corrections --------------------------------------------------------------------------------


def design_factor(tail_ess: np.ndarray, z: float = DESIGN_Z) -> np.ndarray:
    """The design-based inflation of ε̂: √(1 + z/√n_eff) for n_eff = ``tail_ess`` > 0, else 1.

    V̂ is a sum over the sampled slots; with n_eff effective terms its relative standard error is about
    1/√n_eff, so V̂(1 + z/√n_eff) is a one-sided z upper bound on the variance (at most √(1+z) in width,
    when one slot carries all the weight). Needs no calibration data. tail_ess: any shape; NaN stays NaN.
    """
    n = np.asarray(tail_ess, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.sqrt(1.0 + z / np.sqrt(np.where(n > 0, n, 1.0))), np.where(np.isnan(n), np.nan, 1.0))


def minimum_prompts(level: float) -> int:
    """The fewest calibration prompts for which the prompt-exchangeable quantile at ``level`` is finite."""
    return math.ceil(level / (1.0 - level) - 1e-9)


def default_level(delta: float) -> float:
    """The level a calibration aims at unless told otherwise: 1 − δ/5 (0.99 at δ = 0.05).

    Conformal coverage at level L is L in expectation over calibration sets; the coverage of one fitted file
    scatters around it (tens of prompts, whose rows move together), and the worst of a model's layers falls
    below L by more than that scatter's typical size. 1 − δ/2 kept every layer at 1 − δ − 0.01 on the model
    it was chosen on but not on a second architecture with a flat π; 1 − δ/5 is the smallest level of the
    cross-fitted studies that does on both (docs/CALIBRATION-LEVEL.md: the rule, written before its check).
    """
    return 1.0 - float(delta) / 5.0


def needed_prompts(level: float, unit: str, delta: float) -> int:
    """The fewest calibration prompts a fit accepts: with ``unit=prompt``, those that make its quantile finite
    (``minimum_prompts(level)``); with ``unit=row``, those with which even the prompt-level quantile at 1 − δ
    would be (19 at δ = 0.05), so that no calibration rests on a handful of prompts."""
    return minimum_prompts(level if unit == "prompt" else 1.0 - float(delta))


def conformal_quantile(scores: np.ndarray, level: float, groups: np.ndarray | None = None) -> float:
    """The split-conformal quantile of ``scores`` at ``level`` (+inf when the data cannot give one).

    groups None (rows exchangeable): the ⌈(N+1)·level⌉-th smallest of the N scores; a new exchangeable row's
    score is at most it with probability ≥ level. groups (one label per row; prompts exchangeable, rows
    within a prompt not): each of the m groups weighs 1/(m+1), spread evenly over its rows, and the new
    prompt's 1/(m+1) sits at +inf; the smallest t whose weight at or below reaches ``level`` is returned.
    Then the expected fraction of a new prompt's rows with score ≤ t is ≥ level, however its rows depend
    on each other (finite only with m ≥ ``minimum_prompts(level)``). scores: (N,), NaN-free, may hold +inf.
    """
    scores = np.asarray(scores, dtype=float)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level} must lie in (0, 1)")
    if scores.size == 0:
        return math.inf
    order = np.argsort(scores, kind="stable")
    if groups is None:
        rank = math.ceil((scores.size + 1) * level)
        return float(scores[order[rank - 1]]) if rank <= scores.size else math.inf
    _, index, counts = np.unique(np.asarray(groups), return_inverse=True, return_counts=True)
    weights = 1.0 / (counts[index] * (len(counts) + 1.0))
    cumulative = np.cumsum(weights[order])
    reached = np.nonzero(cumulative >= level - 1e-12)[0]
    return float(scores[order[reached[0]]]) if reached.size else math.inf


def _ratio(err: np.ndarray, cert: np.ndarray) -> np.ndarray:
    """‖ô − o‖ / certificate: 0 where both are 0, +inf where only the certificate is."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(cert > 0, err / np.where(cert > 0, cert, 1.0), np.where(err > 0, np.inf, 0.0))


# --- the file -------------------------------------------------------------------------------------------


def _budget_key(budget: float) -> str:
    return f"{float(budget):g}"


@dataclass
class Calibration:
    """A fitted calibration (the JSON file's content).

    strata: {(setting, policy, design, budget-string): {"factors": [q per layer], "cert_weights": [1 or 0 per
    layer], "norm_weights": [τ per layer], "rows": [n per layer], "prompts": m}}: layer ℓ's certificate is
    q_ℓ · (cert_weight_ℓ · base + norm_weight_ℓ · ‖ô‖), base = ε̂ (or its design-based inflation), and with
    ``never_below_paper`` at least ε̂ itself. A factor of None means the layer had no calibration rows (its
    certificate is NaN). Files written before ``never_below_paper`` existed read as False (as they were fitted).
    """

    method: str
    level: float
    base: str
    unit: str
    model: dict
    design: dict
    strata: dict = field(default_factory=dict)
    fitted_on: dict = field(default_factory=dict)
    never_below_paper: bool = False
    source: str = ""  # where it was read from (messages), not stored

    # --- JSON ---

    def to_dict(self) -> dict:
        strata = [{"setting": k[0], "policy": k[1], "design": k[2], "budget": float(k[3]), **v}
                  for k, v in sorted(self.strata.items())]
        return {"format": FORMAT, "version": VERSION, "method": self.method, "level": self.level, "base": self.base,
                "unit": self.unit, "never_below_paper": self.never_below_paper, "model": self.model,
                "design": self.design, "fitted_on": self.fitted_on, "strata": strata}

    def save(self, path: str | Path) -> None:
        write_json_atomic(self.to_dict(), path)

    @classmethod
    def from_dict(cls, payload: Mapping, source: str = "calibration") -> Calibration:
        def need(key, kind):
            if key not in payload:
                raise CalibrationError(f"calibration={source}: missing field {key!r}")
            if not isinstance(payload[key], kind):
                raise CalibrationError(f"calibration={source}: field {key!r} has the wrong type")
            return payload[key]

        if not isinstance(payload, Mapping) or payload.get("format") != FORMAT:
            raise CalibrationError(f"calibration={source}: not a kvcert calibration file (no \"format\": \"{FORMAT}\")")
        if payload.get("version") != VERSION:
            raise CalibrationError(f"calibration={source}: format version {payload.get('version')!r} is not supported "
                                   f"(this kvcert reads version {VERSION}); refit it with kvcert-calibrate")
        method, base, unit = need("method", str), need("base", str), need("unit", str)
        for name, value, known in (("method", method, METHODS), ("base", base, BASES), ("unit", unit, UNITS)):
            if value not in known:
                raise CalibrationError(f"calibration={source}: {name}={value!r} is unknown; known: {list(known)}")
        strata = {}
        for i, entry in enumerate(need("strata", list)):
            try:
                key = (str(entry["setting"]), str(entry["policy"]), str(entry["design"]), _budget_key(entry["budget"]))
                factors = [None if f is None else float(f) for f in entry["factors"]]
                cert_weights = [float(w) for w in entry["cert_weights"]]
                norm_weights = [float(w) for w in entry["norm_weights"]]
                rows = [int(r) for r in entry["rows"]]
                value = {"factors": factors, "cert_weights": cert_weights, "norm_weights": norm_weights, "rows": rows,
                         "prompts": int(entry["prompts"])}
            except (KeyError, TypeError, ValueError) as err:
                raise CalibrationError(f"calibration={source}: strata[{i}] is malformed ({type(err).__name__}: {err})") from None
            lists = (factors, cert_weights, norm_weights, rows)
            if (any(f is not None and not f >= 0 for f in factors) or any(not w >= 0 for w in cert_weights + norm_weights)
                    or len({len(x) for x in lists}) != 1):
                raise CalibrationError(f"calibration={source}: strata[{i}] holds a negative factor or weight, or lists "
                                       "of different lengths")
            strata[key] = value
        level = need("level", (int, float))
        if not 0.0 < float(level) < 1.0:
            raise CalibrationError(f"calibration={source}: level={level} must lie in (0, 1)")
        never_below_paper = payload.get("never_below_paper", False)
        if not isinstance(never_below_paper, bool):
            raise CalibrationError(f"calibration={source}: field 'never_below_paper' has the wrong type")
        return cls(method=method, level=float(level), base=base, unit=unit, model=dict(need("model", dict)),
                   design=dict(need("design", dict)), strata=strata, fitted_on=dict(payload.get("fitted_on") or {}),
                   never_below_paper=never_below_paper, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        if not path.is_file():
            raise CalibrationError(f"calibration={path}: no such file")
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CalibrationError(f"calibration={path}: not a kvcert calibration file ({type(err).__name__}: "
                                   f"{' '.join(str(err).split())})") from None
        return cls.from_dict(payload, source=str(path))

    # --- checks ---

    def check_model(self, identity: Mapping) -> None:
        """Refuse a model other than the one the factors were fitted on (one line naming both)."""
        for key in ("config_sha256", "weights_sha256"):
            if self.model.get(key) != identity.get(key):
                what = "architecture/config" if key == "config_sha256" else "weights"
                raise CalibrationError(
                    f"calibration={self.source} was fitted on another model ({what} differ: {key} "
                    f"{str(self.model.get(key))[:12]} in the file, {str(identity.get(key))[:12]} here; fitted on "
                    f"{self.model.get('name') or self.model.get('model_type')}): fit one for this model with kvcert-calibrate")

    def check_design(self, knobs: Mapping) -> None:
        """Refuse knobs that change π or ε̂ (one line naming the first differing knob)."""
        for name in KNOBS:
            mine, theirs = self.design.get(name), knobs.get(name)
            same = (math.isclose(float(mine), float(theirs), rel_tol=1e-9, abs_tol=0.0)
                    if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) else mine == theirs)
            if not same:
                raise CalibrationError(
                    f"calibration={self.source}: {knob_label(name)}={theirs} here but {mine} in the file: the factors "
                    f"hold for the design they were fitted with; refit with kvcert-calibrate or use the file's value")

    def stratum(self, setting: str, policy: str, design: str, budget: float) -> dict:
        key = (setting, policy, design, _budget_key(budget))
        if key not in self.strata:
            held = ", ".join(f"{s}/{p}/{d}/{b}" for s, p, d, b in sorted(self.strata)) or "none"
            raise CalibrationError(
                f"calibration={self.source} has no factors for setting={setting} policy={policy} design={design} "
                f"budget={_budget_key(budget)}; it holds (setting/policy/design/budget): {held}")
        return self.strata[key]

    def check_prompts(self, prompts: Iterable[tuple[str, str]]) -> None:
        """Refuse evaluation prompts the factors were fitted on, or of a task they never saw.

        prompts: (item id, task) of every prompt the file is about to be used on. The guarantee assumes
        prompts exchangeable with the calibration set; a prompt of the calibration set makes coverage
        optimistic, and a task absent from it is a shift the factors know nothing about. Files that do not
        record their tasks (written before they did) are checked on item ids only.
        """
        prompts = list(prompts)
        fitted = set(self.fitted_on.get("item_ids") or ())
        reused = sorted(i for i, _ in prompts if i in fitted)
        if reused:
            raise CalibrationError(
                f"calibration={self.source} was fitted on {len(reused)} of this run's {len(prompts)} prompts "
                f"(e.g. {reused[0]}): evaluate on prompts it never saw (another shard: same n_shards and shard_by, "
                "another shard index), or set check_calibration_prompts=false")
        tasks = self.fitted_on.get("tasks")
        if tasks:
            unseen = sorted({t for _, t in prompts} - set(tasks))
            if unseen:
                raise CalibrationError(
                    f"calibration={self.source} was fitted on tasks {sorted(tasks)}, but this run holds {unseen}: the "
                    "factors assume prompts like the calibration set's; calibrate on these tasks (with several "
                    "tasks, shard both runs with shard_by=task), or set check_calibration_prompts=false")

    def check_configurations(self, setting: str, configurations: Iterable[tuple[str, str, float]]) -> None:
        """Every (policy, design, budget) with a certificate (design ``poisson``) must have factors."""
        for policy, design, budget in configurations:
            if design == "poisson":
                self.stratum(setting, policy, design, budget)


def load_calibration(value) -> Calibration | str | None:
    """A ``calibration=`` value: None, ``design`` (the data-free correction), a Calibration, or a file path."""
    if value is None or isinstance(value, Calibration):
        return value
    if str(value) == DESIGN:
        return DESIGN
    return Calibration.load(value)


# --- fitting ----------------------------------------------------------------------------------------------


def fit_calibration(steps: pd.DataFrame, *, model: Mapping, design: Mapping, level: float | None = None,
                    base: str = "paper", unit: str = "row", relative_term: bool = True,
                    never_below_paper: bool = True, fitted_on: Mapping | None = None) -> Calibration:
    """Per-layer conformal factors from oracle step rows (``KEY_COLUMNS`` + ``STEP_COLUMNS``).

    One stratum per (setting, policy, design, budget) with a certificate; within it, per layer
    (``model["num_layers"]`` of them), a base certificate b and the conformal quantile q at ``level``
    (default ``default_level``) of ‖ô − o‖ / b (groups are items when ``unit`` is ``prompt``). b is
    ε̂ (``base="paper"``) or ε̂ · ``design_factor`` (``base="design"``), plus, with ``relative_term``, τ‖ô‖:
    of the candidates τ ∈ ``NORM_WEIGHTS`` and ‖ô‖ alone that rank the layer's calibration errors (Spearman)
    at most ``RANK_TOLERANCE`` worse than ε̂ does, the one whose certificate q · b has the smallest median over
    the layer's calibration rows (τ is chosen on the same rows, which makes the level approximate; the
    held-out coverage is measured in README). ``never_below_paper`` leaves the fit as it is and is recorded in
    the file: the certificate applied is then max(q · b, ε̂) row by row, so that calibration widens the paper's
    certificate where it fails and never narrows it (docs/CALIBRATION-LEVEL.md, *Third confirmation*). Rows
    without a true error (oracle off) or without a certificate are ignored.
    """
    if base not in BASES:
        raise CalibrationError(f"base={base!r} is unknown; known: {list(BASES)}")
    if unit not in UNITS:
        raise CalibrationError(f"unit={unit!r} is unknown; known: {list(UNITS)}")
    level = default_level(design["delta"]) if level is None else float(level)
    if not 0.0 < level < 1.0:
        raise CalibrationError(f"level={level}: must lie in (0, 1)")
    rows = steps[np.isfinite(steps["cert"].to_numpy(float)) & np.isfinite(steps["true_err"].to_numpy(float))]
    if rows.empty:
        raise CalibrationError("no step rows with both a certificate and a true error to calibrate on "
                               "(the oracle must be on and some design must be poisson)")
    n_layers = int(model.get("num_layers") or int(rows["layer"].max()) + 1)
    err, cert, norm = rows["true_err"].to_numpy(float), _base(rows, base), output_norm(rows)
    candidates = [(1.0, tau) for tau in (NORM_WEIGHTS if relative_term else (0.0,))]
    candidates += [(0.0, 1.0)] if relative_term else []
    strata = {}
    for key, index in rows.groupby(list(STRATUM_KEYS), sort=True).indices.items():
        setting, policy, design_name, budget = key
        sub = rows.iloc[index]
        items = sub["item_id"].to_numpy()
        need = needed_prompts(level, unit, design["delta"])
        if len(np.unique(items)) < need:
            raise CalibrationError(
                f"{len(np.unique(items))} calibration prompts for setting={setting} policy={policy} budget={budget:g}: "
                f"unit={unit} at level={level:g} needs at least {need}")
        layers = sub["layer"].to_numpy(int)
        fitted = {"factors": [], "cert_weights": [], "norm_weights": [], "rows": []}
        for layer in range(n_layers):
            mask = layers == layer
            at = index[mask]
            fitted["rows"].append(int(mask.sum()))
            if not mask.any():
                for name, empty in (("factors", None), ("cert_weights", 1.0), ("norm_weights", 0.0)):
                    fitted[name].append(empty)
                continue
            best, floor = None, None
            for weights in candidates:  # the first is ε̂ itself: its rank correlation sets the floor
                b = weights[0] * cert[at] + weights[1] * norm[at]
                rank = _rank_correlation(b, err[at])
                floor = rank - RANK_TOLERANCE if floor is None else floor
                if rank < floor:
                    continue
                q = conformal_quantile(_ratio(err[at], b), level, items[mask] if unit == "prompt" else None)
                width = float(np.median(q * b)) if math.isfinite(q) else math.inf
                if best is None or width < best[0]:
                    best = (width, q, weights)
            if not math.isfinite(best[1]):
                raise CalibrationError(
                    f"layer {layer} of setting={setting} policy={policy} budget={budget:g} has {int(mask.sum())} "
                    f"calibration rows, too few for a finite quantile at level={level:g}; use more prompts")
            fitted["factors"].append(float(best[1]))
            fitted["cert_weights"].append(best[2][0])
            fitted["norm_weights"].append(best[2][1])
        strata[(str(setting), str(policy), str(design_name), _budget_key(budget))] = {
            **fitted, "prompts": int(len(np.unique(items)))}
    return Calibration(method="conformal", level=level, base=base, unit=unit, model=dict(model), design=dict(design),
                       strata=strata, fitted_on=dict(fitted_on or {}), never_below_paper=bool(never_below_paper))


def _rank_correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's ρ, or −1 where either side is constant (nothing ranked)."""
    from scipy.stats import spearmanr

    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return -1.0
    return float(spearmanr(x, y).statistic)


def _base(steps: pd.DataFrame, base: str) -> np.ndarray:
    cert = steps["cert"].to_numpy(float)
    return cert * design_factor(steps["tail_ess"].to_numpy(float)) if base == "design" else cert


def output_norm(steps: pd.DataFrame) -> np.ndarray:
    """‖ô‖ of every row, (N,): the ``out_norm`` column, or (tables written before it existed) ε̂/rel_cert or
    ‖ô − o‖/rel_err where those are positive, else 0."""
    if "out_norm" in steps:
        return steps["out_norm"].to_numpy(float)
    out = np.zeros(len(steps))
    with np.errstate(invalid="ignore", divide="ignore"):
        for value, relative in (("true_err", "rel_err"), ("cert", "rel_cert")):
            v, r = steps[value].to_numpy(float), steps[relative].to_numpy(float)
            out = np.where((out == 0) & (r > 0) & np.isfinite(v), v / np.where(r > 0, r, 1.0), out)
    return out


# --- applying ---------------------------------------------------------------------------------------------


def calibrated_certificate(calibration: Calibration | str, steps: pd.DataFrame, *, setting: str, policy: str,
                           design: str, budget: float) -> np.ndarray:
    """cert_calibrated for one configuration's step rows, (N,): NaN where ε̂ is NaN (deterministic designs)."""
    cert = steps["cert"].to_numpy(float)
    if calibration == DESIGN:
        return np.maximum(cert * design_factor(steps["tail_ess"].to_numpy(float)), ROUNDING * output_norm(steps))
    if design != "poisson" or not len(steps):
        return np.full(len(steps), np.nan)
    stratum = calibration.stratum(setting, policy, design, budget)
    factors = np.array([np.nan if f is None else f for f in stratum["factors"]], dtype=float)
    layers = steps["layer"].to_numpy(int)
    if layers.size and layers.max() >= factors.size:
        raise CalibrationError(f"calibration={calibration.source} holds {factors.size} layers; the model has layer "
                               f"{int(layers.max())}")
    cert_w = np.asarray(stratum["cert_weights"], dtype=float)[layers]
    norm_w = np.asarray(stratum["norm_weights"], dtype=float)[layers]
    base, norm = _base(steps, calibration.base), output_norm(steps)
    calibrated = factors[layers] * (cert_w * np.nan_to_num(base) + norm_w * norm)
    if calibration.never_below_paper:
        calibrated = np.maximum(calibrated, np.nan_to_num(cert))
    # ε̂ is NaN exactly where there is no certificate (deterministic rows): keep that NaN whatever the weights
    return np.where(np.isfinite(base), np.maximum(calibrated, ROUNDING * norm), np.nan)


def prepare_calibration(calibration, *, model=None, setting: str, configurations: Iterable[tuple[str, str, float]],
                        options: DesignOptions = DesignOptions(), delta: float = defaults.DELTA,
                        observation_window: int = defaults.OBSERVATION_WINDOW,
                        policy_options: Mapping | None = None) -> Calibration | str:
    """Load a ``calibration=`` value and check it, before anything is computed: a file must have been fitted
    on ``model`` (when given) with these knobs, and hold factors for every (policy, design, budget) of
    ``configurations`` that has a certificate. Raises CalibrationError (one line)."""
    calibration = load_calibration(calibration)
    if isinstance(calibration, Calibration):
        if model is not None:
            calibration.check_model(model_identity(model))
        calibration.check_design(design_knobs(options, delta=delta, observation_window=observation_window,
                                              policy_options=policy_options))
        calibration.check_configurations(setting, configurations)
    return calibration


def apply_calibration(calibration, steps: pd.DataFrame, *, model=None, design: str, policy: str, budget: float,
                      setting: str, options: DesignOptions = DesignOptions(), delta: float = defaults.DELTA,
                      observation_window: int = defaults.OBSERVATION_WINDOW, policy_options: Mapping | None = None,
                      checked: bool = False) -> pd.DataFrame:
    """``steps`` (one configuration's STEP_COLUMNS rows) with ``CALIBRATED_STEP_COLUMNS`` added.

    calibration: a Calibration, a path to one, or ``design``. Unless ``checked`` (the caller ran
    ``prepare_calibration`` once, as ``generate`` and the cell runner do), it is prepared here first.
    coverage_calibrated is NaN without a true error or a certificate.
    """
    if not checked:
        calibration = prepare_calibration(calibration, model=model, setting=setting,
                                          configurations=[(policy, design, budget)], options=options, delta=delta,
                                          observation_window=observation_window, policy_options=policy_options)
    out = steps.copy()
    cal = calibrated_certificate(calibration, steps, setting=setting, policy=policy, design=design, budget=budget)
    err = steps["true_err"].to_numpy(float) if len(steps) else np.array([])
    with np.errstate(invalid="ignore"):
        covered = np.where(np.isfinite(cal) & np.isfinite(err), (err <= cal).astype(float), np.nan)
    out[CALIBRATED_STEP_COLUMNS[0]] = cal
    out[CALIBRATED_STEP_COLUMNS[1]] = covered
    return out


def calibration_summary(steps: pd.DataFrame) -> dict[str, float]:
    """Item-level ``CALIBRATED_ITEM_COLUMNS`` of one configuration's calibrated step rows: the mean and max of
    the relative calibrated certificate (cert_calibrated/‖ô‖, like ``cert_mean``/``cert_max``) and the
    fraction of rows it covered; NaN where undefined."""
    if not len(steps) or CALIBRATED_STEP_COLUMNS[0] not in steps:
        return dict.fromkeys(CALIBRATED_ITEM_COLUMNS, float("nan"))
    cal, cert = steps["cert_calibrated"].to_numpy(float), steps["cert"].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        relative = steps["rel_cert"].to_numpy(float) * np.where(cert > 0, cal / np.where(cert > 0, cert, 1.0), 1.0)
    relative = relative[np.isfinite(relative)]
    covered = steps["coverage_calibrated"].to_numpy(float)
    covered = covered[np.isfinite(covered)]
    return {"cert_calibrated_mean": float(relative.mean()) if relative.size else float("nan"),
            "cert_calibrated_max": float(relative.max()) if relative.size else float("nan"),
            "coverage_calibrated": float(covered.mean()) if covered.size else float("nan")}


# --- the per-layer table ----------------------------------------------------------------------------------

Z95 = 1.959963984540054


def wilson_interval(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (rows as independent trials)."""
    if n <= 0:
        return float("nan"), float("nan")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


BY_LAYER_KEYS = ["model", "setting", "policy", "design", "budget", "layer"]


def by_layer(steps: pd.DataFrame, keys: list[str] | None = None) -> pd.DataFrame:
    """Calibration of the certificate ``cert`` = √(tr V̂/δ) per ``keys`` (default ``BY_LAYER_KEYS``, of which
    ``model`` is optional), one row each.

    Over the rows with a certificate and a true error: n_rows, n_items, coverage with its 95% Wilson
    interval (rows as independent trials: rows of one item are not, so it is narrower than an item-level
    interval), mean Wald coverage, median relative width ε̂/‖ô‖, Spearman(ε̂, ‖ô − o‖), and
    uncovered_at_rounding, the uncovered rows whose error is float32 rounding (≤ ``ROUNDING`` ‖ô‖: ε̂ = 0
    where nothing in the layer's view was evicted); and, where the rows carry ``cert_calibrated``, the
    same for the calibrated certificate.
    """
    from scipy.stats import spearmanr

    keys = [k for k in (keys or BY_LAYER_KEYS) if k in steps.columns]
    ok = np.isfinite(steps["cert"].to_numpy(float)) & np.isfinite(steps["true_err"].to_numpy(float))
    rows = steps[ok]
    calibrated = "cert_calibrated" in rows.columns
    out = []
    for key, sub in rows.groupby(keys, sort=True):
        e, c = sub["true_err"].to_numpy(float), sub["cert"].to_numpy(float)
        rel = sub["rel_cert"].to_numpy(float)
        record = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        covered = float((e <= c).sum())
        low, high = wilson_interval(covered, len(sub))
        rounding = (e > c) & (e <= ROUNDING * output_norm(sub))
        record.update(n_rows=len(sub), n_items=int(sub["item_id"].nunique()) if "item_id" in sub else np.nan,
                      coverage=covered / len(sub), coverage_low=low, coverage_high=high,
                      uncovered_at_rounding=int(rounding.sum()),
                      wald_coverage=float(np.nanmean(sub["wald_coverage"])) if sub["wald_coverage"].notna().any() else np.nan,
                      median_rel_width=float(np.nanmedian(sub["rel_cert"])),
                      spearman=_spearman(spearmanr, c, e))
        if calibrated:
            cal = sub["cert_calibrated"].to_numpy(float)
            good = np.isfinite(cal)
            hit = float((e[good] <= cal[good]).sum())
            low, high = wilson_interval(hit, int(good.sum()))
            with np.errstate(invalid="ignore", divide="ignore"):  # cal/‖ô‖ = rel_cert · cal/ε̂ (0 where both are 0)
                rel_cal = np.where(c > 0, rel * cal / np.where(c > 0, c, 1.0), np.where(cal > 0, np.inf, 0.0))
            record.update(coverage_calibrated=hit / good.sum() if good.any() else np.nan,
                          coverage_calibrated_low=low, coverage_calibrated_high=high,
                          median_rel_width_calibrated=float(np.median(rel_cal[good])) if good.any() else np.nan,
                          spearman_calibrated=_spearman(spearmanr, cal[good], e[good]))
        out.append(record)
    return pd.DataFrame(out)


def _spearman(spearmanr, x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 3 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    return float(spearmanr(x, y).statistic)


__all__ = [
    "BASES", "BY_LAYER_KEYS", "Calibration", "DESIGN", "DESIGN_Z", "FORMAT", "METHODS", "NORM_WEIGHTS",
    "RANK_TOLERANCE", "ROUNDING", "UNITS",
    "VERSION", "output_norm",
    "apply_calibration", "by_layer", "calibrated_certificate", "calibration_summary", "conformal_quantile",
    "default_level", "design_factor", "design_knobs", "fit_calibration", "needed_prompts", "knob_label", "load_calibration", "minimum_prompts", "model_identity",
    "prepare_calibration", "wilson_interval",
]

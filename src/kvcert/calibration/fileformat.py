"""The calibration file: a small versioned JSON document of fitted factors, bound to a model and design knobs.

``Calibration`` is the file's content, its reader (every malformed field refused in one line naming the file)
and the checks a run makes before it uses one: the model, the design knobs, the strata it needs and the
prompts it is about to score. ``load_calibration`` reads a ``calibration=`` value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from ..atomic import write_json_atomic
from ..errors import CalibrationError
from .knobs import KNOBS, absent_knob, knob_label

FORMAT = "kvcert-calibration"
VERSION = 1
METHODS = ("conformal", "design")
BASES = ("paper", "design")  # what the conformal factor multiplies: ε̂, or the design-inflated ε̂
UNITS = ("row", "prompt")  # what the conformal quantile treats as exchangeable
DESIGN = "design"  # ``calibration=design``: the data-free correction, no file


def budget_key(budget: float) -> str:
    """A budget as a stratum's key spells it (0.25 -> "0.25", 1.0 -> "1")."""
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
                key = (str(entry["setting"]), str(entry["policy"]), str(entry["design"]), budget_key(entry["budget"]))
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
            mine, theirs = self.design.get(name, absent_knob(name)), knobs.get(name, absent_knob(name))
            same = (math.isclose(float(mine), float(theirs), rel_tol=1e-9, abs_tol=0.0)
                    if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) else mine == theirs)
            if not same:
                raise CalibrationError(
                    f"calibration={self.source}: {knob_label(name)}={theirs} here but {mine} in the file: the factors "
                    f"hold for the design they were fitted with; refit with kvcert-calibrate or use the file's value")

    def stratum(self, setting: str, policy: str, design: str, budget: float) -> dict:
        key = (setting, policy, design, budget_key(budget))
        if key not in self.strata:
            held = ", ".join(f"{s}/{p}/{d}/{b}" for s, p, d, b in sorted(self.strata)) or "none"
            raise CalibrationError(
                f"calibration={self.source} has no factors for setting={setting} policy={policy} design={design} "
                f"budget={budget_key(budget)}; it holds (setting/policy/design/budget): {held}")
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

"""The design knobs a calibration is bound to: those that decide π and ε̂, and so the fitted factors.

A file records ``design_knobs(...)`` when it is fitted; ``Calibration.check_design`` refuses a run whose knobs
differ (one line naming the knob as the run configuration spells it, ``knob_label``).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .. import defaults
from ..designs import DesignOptions

KNOBS = ("n_sink", "n_recent", "head_fraction", "pi_min", "delta", "observation_window", "policy_options")
# Knobs that live under ``design_options`` in a run configuration; the rest are top-level keys.
_DESIGN_OPTIONS = ("n_sink", "n_recent", "head_fraction", "pi_min")


def design_knobs(options: DesignOptions = DesignOptions(), *, delta: float = defaults.DELTA,
                 observation_window: int = defaults.OBSERVATION_WINDOW,
                 policy_options: Mapping | None = None) -> dict[str, Any]:
    """The knobs that decide π and ε̂, and so the calibration factors (``KNOBS``)."""
    return {"n_sink": int(options.n_sink), "n_recent": int(options.n_recent),
            "head_fraction": float(options.head_fraction), "pi_min": float(options.pi_min), "delta": float(delta),
            "observation_window": int(observation_window),
            "policy_options": json.loads(json.dumps(dict(policy_options or {}), sort_keys=True))}


def knob_label(name: str) -> str:
    """A knob's name as a run configuration spells it (for messages)."""
    return f"design_options.{name}" if name in _DESIGN_OPTIONS else name

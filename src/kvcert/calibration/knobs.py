"""The design knobs a calibration is bound to: those that decide π and ε̂, and so the fitted factors.

Which knobs these are is the run configuration's schema (``kvcert.run_schema``: the fields marked
``design_knob``). A file records ``design_knobs(...)`` when it is fitted; ``Calibration.check_design`` refuses a
run whose knobs differ (one line naming the knob as the run configuration spells it, ``knob_label``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from ..run_schema import DESIGN_ELIDED_AT_DEFAULT, DESIGN_KNOBS, RUN, DesignOptions

KNOBS = DESIGN_KNOBS
ELIDED = DESIGN_ELIDED_AT_DEFAULT
# Knobs that live under ``design_options`` in a run configuration; the rest are top-level keys.
_DESIGN_OPTIONS = tuple(f.name for f in dataclasses.fields(DesignOptions))


def design_knobs(options: DesignOptions = DesignOptions(), *, delta: float = RUN.delta,
                 observation_window: int = RUN.observation_window,
                 policy_options: Mapping | None = None) -> dict[str, Any]:
    """The knobs that decide π and ε̂, and so the calibration factors (``KNOBS``, in that order)."""
    values = {**{name: getattr(options, name) for name in _DESIGN_OPTIONS}, "delta": delta,
              "observation_window": observation_window,
              "policy_options": json.loads(json.dumps(dict(policy_options or {}), sort_keys=True))}
    kinds = {f.name: type(f.default) for f in (*dataclasses.fields(DesignOptions), *dataclasses.fields(RUN))
             if isinstance(f.default, (int, float)) and not isinstance(f.default, bool)}
    knobs = {name: kinds[name](values[name]) if name in kinds else values[name] for name in KNOBS}
    # a knob added after committed files (the defenses) is recorded only away from its default: a file fitted at
    # it is written as before, and a file without it was fitted at it (``absent_knob``)
    return {name: value for name, value in knobs.items() if not (name in ELIDED and value == absent_knob(name))}


def absent_knob(name: str) -> Any:
    """The value of a knob that a file (or a run's knobs) does not record: the default of one recorded only away
    from it (ELIDED), else None."""
    return getattr(RUN.design_options, name) if name in ELIDED else None


def knob_label(name: str) -> str:
    """A knob's name as a run configuration spells it (for messages)."""
    return f"design_options.{name}" if name in _DESIGN_OPTIONS else name

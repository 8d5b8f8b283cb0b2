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

Modules, one job each: ``fingerprint`` (the model's identity), ``knobs`` (the design knobs a file is bound
to), ``corrections`` (the design factor, the conformal quantile and the rows they act on), ``fileformat``
(the JSON file and its checks), ``fit``, ``apply``, ``report`` (the per-layer table) and ``ranks`` (Spearman's
ρ, the project's one helper outside the frozen analysis). Everything is importable from ``kvcert.calibration``.
"""

from .apply import apply_calibration, calibrated_certificate, calibration_summary, prepare_calibration
from .corrections import (DESIGN_Z, ROUNDING, base_certificate, conformal_quantile, default_level, design_factor,
                          minimum_prompts, needed_prompts, output_norm)
from .fileformat import BASES, DESIGN, FORMAT, METHODS, UNITS, VERSION, Calibration, load_calibration
from .fingerprint import model_identity
from .fit import NORM_WEIGHTS, RANK_TOLERANCE, STRATUM_KEYS, fit_calibration
from .knobs import KNOBS, design_knobs, knob_label
from .ranks import spearman
from .report import BY_LAYER_KEYS, Z95, by_layer, wilson_interval

__all__ = [
    "BASES", "BY_LAYER_KEYS", "Calibration", "DESIGN", "DESIGN_Z", "FORMAT", "KNOBS", "METHODS", "NORM_WEIGHTS",
    "RANK_TOLERANCE", "ROUNDING", "STRATUM_KEYS", "UNITS", "VERSION", "Z95",
    "apply_calibration", "base_certificate", "by_layer", "calibrated_certificate", "calibration_summary",
    "conformal_quantile", "default_level", "design_factor", "design_knobs", "fit_calibration", "knob_label",
    "load_calibration", "minimum_prompts", "model_identity", "needed_prompts", "output_norm", "prepare_calibration",
    "spearman", "wilson_interval",
]

"""Every error kvcert raises on purpose. Each message is the one line a user sees: it names the key,
value or file at fault. This module imports nothing from kvcert, so every layer can use it."""

from __future__ import annotations


class EmptyRetainedSetError(ValueError):
    """An attention row has no retained slot: the estimator is undefined there."""


class ConfigError(ValueError):
    """A configuration value that cannot be run; the message names the key and the value."""


class UsageError(ValueError):
    """Bad command-line overrides."""


class ModelLoadError(RuntimeError):
    """A model spec that cannot be resolved or loaded; the message names the key or file."""


class CalibrationError(ValueError):
    """A calibration file that does not fit the model or design it is applied to."""


class AnalysisError(Exception):
    """Bad or missing input to an analysis (names the file, key or value at fault)."""


class PreregistrationError(AnalysisError):
    """The pre-registration lock is missing or does not match the frozen files."""


__all__ = [
    "AnalysisError",
    "CalibrationError",
    "ConfigError",
    "EmptyRetainedSetError",
    "ModelLoadError",
    "PreregistrationError",
    "UsageError",
]

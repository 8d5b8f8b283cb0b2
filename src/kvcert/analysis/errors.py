"""Errors raised by the analysis (defined in ``kvcert.errors``; re-exported here for the analysis modules)."""

from kvcert.errors import AnalysisError, PreregistrationError

__all__ = ["AnalysisError", "PreregistrationError"]

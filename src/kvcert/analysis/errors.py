"""Errors raised by the analysis; their message is the one line a user sees."""


class AnalysisError(Exception):
    """Bad or missing input to an analysis (names the file, key or value at fault)."""


class PreregistrationError(AnalysisError):
    """The pre-registration lock is missing or does not match the frozen files."""

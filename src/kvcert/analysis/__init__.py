"""Pre-registered statistics for the seven kvcert claims.

Modules: ``stats`` (bootstrap, AUC, Spearman), ``data`` (cell tables and population filters),
``verdicts`` (decision rules), ``replay`` (escalation / recompute replays), ``claims`` (one function
per claim, registered by id), ``figures``, ``aggregate`` (tables), ``prereg`` (lock / verify /
render of the pre-registration) and ``cli`` (the ``kvcert-claim`` Hydra app).
"""

from kvcert.analysis.errors import AnalysisError, PreregistrationError

__all__ = ["AnalysisError", "PreregistrationError"]

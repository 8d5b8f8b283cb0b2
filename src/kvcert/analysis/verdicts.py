"""Decision rules: from a confidence interval and a frozen threshold to a verdict.

Rule for one component (direction "greater": the hypothesis says the quantity exceeds the
threshold; "less" mirrors it):
- supported      if the whole CI is on the hypothesis side:            ci_low  > threshold
- not supported  if the CI excludes every value that would support it: ci_high < threshold + null_margin
- inconclusive   otherwise (also when the CI is undefined).
``null_margin`` (>= 0) is the smallest improvement that counts: with a margin m, a CI that lies
below threshold + m shows the effect is practically absent ("adds nothing"). It is 0 for
non-inferiority and plain threshold claims. "supported" is checked first.

A claim with several components is supported iff all are, not supported iff any is, inconclusive
otherwise (an intersection-union test: no multiplicity correction is needed for "all").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.stats import Interval

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not supported", "inconclusive"
VERDICTS = (SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE)


def _greater(lo: float, hi: float, thr: float, margin: float) -> str:
    if lo > thr:
        return SUPPORTED
    if hi < thr + margin:
        return NOT_SUPPORTED
    return INCONCLUSIVE


def _less(lo: float, hi: float, thr: float, margin: float) -> str:
    if hi < thr:
        return SUPPORTED
    if lo > thr - margin:
        return NOT_SUPPORTED
    return INCONCLUSIVE


RULES: dict[str, Callable[[float, float, float, float], str]] = {"greater": _greater, "less": _less}
# Signed distance of the CI from failing to support: smallest = the component that binds.
SLACK: dict[str, Callable[[float, float, float], float]] = {
    "greater": lambda lo, hi, thr: lo - thr,
    "less": lambda lo, hi, thr: thr - hi,
}


@dataclass(frozen=True)
class Component:
    """One tested quantity of a claim with its frozen rule and its verdict."""

    name: str
    estimate: float
    ci_low: float
    ci_high: float
    threshold: float
    direction: str
    null_margin: float
    verdict: str

    def as_dict(self) -> dict:
        return asdict(self)


def decide(name: str, interval: Interval, rule: dict) -> Component:
    """Apply a component rule ``{threshold, direction, null_margin}`` from claims.yaml."""
    try:
        thr = float(rule["threshold"])
        direction = str(rule.get("direction", "greater"))
        margin = float(rule.get("null_margin", 0.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise AnalysisError(f"claims.yaml: decision rule for {name!r} is malformed ({exc})") from None
    if direction not in RULES:
        raise AnalysisError(f"claims.yaml: decision direction {direction!r} for {name!r} is not one of {sorted(RULES)}")
    lo, hi = interval.low, interval.high
    verdict = INCONCLUSIVE if (math.isnan(lo) or math.isnan(hi)) else RULES[direction](lo, hi, thr, margin)
    return Component(name, interval.estimate, lo, hi, thr, direction, margin, verdict)


def combine(components: Sequence[Component]) -> str:
    """All supported -> supported; any not supported -> not supported; else inconclusive."""
    verdicts = [c.verdict for c in components]
    if verdicts and all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    if any(v == NOT_SUPPORTED for v in verdicts):
        return NOT_SUPPORTED
    return INCONCLUSIVE


def binding(components: Sequence[Component]) -> Component:
    """The component a one-line table reports: among those whose verdict equals the claim's, the
    one closest to failing (smallest slack). So the reported CI always explains the verdict.

    Components with an undefined CI count as closest (they are what makes a claim inconclusive).
    """
    verdict = combine(components)

    def slack(c: Component) -> float:
        s = SLACK[c.direction](c.ci_low, c.ci_high, c.threshold)
        return -math.inf if math.isnan(s) else s

    return min((c for c in components if c.verdict == verdict), key=slack)


def agrees(verdict: str, paper_verdict: str) -> bool | None:
    """Whether our verdict matches the paper's; None when ours is inconclusive."""
    return None if verdict == INCONCLUSIVE else verdict == paper_verdict

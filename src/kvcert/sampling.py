"""Inclusion probabilities for the randomized design, and Poisson sampling (docs/METHOD.md §2).

A row of n cached tokens is split into a certainty head (π = 1: attention sinks, the most recent window
and a top slice of the score ranking) and a tail whose tokens are kept independently with π ∝ score,
capped at 1 and floored at ``pi_min``, scaled so that Σπ over the row equals the expected retained count.

``inclusion_probabilities`` takes one expected count for every row; ``row_inclusion_probabilities`` one count per
row (a target's per-head sizes, kvcert.targets), the same π with the tail's level solved exactly.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

from .run_schema import DESIGN
from .seeding import generator_or_seeded_zero


def certain_mask(n: int, n_sink: int, n_recent: int, device=None) -> torch.Tensor:
    """(n,) bool: the first n_sink and the last n_recent positions."""
    pos = torch.arange(n, device=device)
    return (pos < n_sink) | (pos >= n - n_recent)


def minimum_count(n: int, n_sink: int = DESIGN.n_sink, n_recent: int = DESIGN.n_recent) -> int:
    """The smallest retained count a design allows: the sinks plus the recent window (or n)."""
    return min(n, n_sink + n_recent)


def retained_count(budget: float, n: int, n_sink: int = DESIGN.n_sink, n_recent: int = DESIGN.n_recent) -> int:
    """Retained tokens (expected, for the Poisson design) for a budget fraction of n tokens: round(budget·n),
    raised to the sinks + recent window minimum, so never 0."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget={budget} must lie in (0, 1]")
    return max(minimum_count(n, n_sink, n_recent), min(n, round(budget * n)))


def _water_fill(scores: torch.Tensor, tail: torch.Tensor, target: torch.Tensor, pi_min: float) -> torch.Tensor:
    """π = clip(c·score, pi_min, 1) on tail slots with Σ_tail π = target per row (bisection on log c).

    scores: (R, n) float64 >= 0; tail: (R, n) bool; target: (R,) float64 with
    pi_min·|tail| <= target <= |tail|. Returns (R, n) float64, zero off the tail.
    """
    # Strictly positive scores make Σ clip(c·s) continuous and strictly increasing up to |tail|.
    row_max = torch.where(tail, scores, torch.zeros_like(scores)).amax(-1, keepdim=True)
    s = scores.clamp_min(0.0) + 1e-9 * row_max + 1e-300
    s = torch.where(tail, s, torch.zeros_like(s))
    positive = torch.where(tail, s, torch.full_like(s, float("inf")))
    lo = torch.log(torch.full_like(target, 1e-300)) - torch.log(s.amax(-1).clamp_min(1e-300))
    hi = -torch.log(positive.amin(-1))  # c·min(s) = 1: everything capped
    lo, hi = lo.clone(), hi.clone() + 1.0

    def total(log_c: torch.Tensor) -> torch.Tensor:
        pi = (s * torch.exp(log_c).unsqueeze(-1)).clamp(pi_min, 1.0)
        return torch.where(tail, pi, torch.zeros_like(pi)).sum(-1)

    for _ in range(100):
        mid = 0.5 * (lo + hi)
        below = total(mid) < target
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    pi = (s * torch.exp(hi).unsqueeze(-1)).clamp(pi_min, 1.0)
    return torch.where(tail, pi, torch.zeros_like(pi))


def inclusion_probabilities(
    scores: torch.Tensor,
    expected_count: float,
    *,
    n_sink: int = DESIGN.n_sink,
    n_recent: int = DESIGN.n_recent,
    head_fraction: float = DESIGN.head_fraction,
    pi_min: float = DESIGN.pi_min,
    certain: torch.Tensor | None = None,
    tail_mix: float = DESIGN.tail_mix,
    head_attention_share: float = DESIGN.head_attention_share,
    attention: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inclusion probabilities π for the randomized design.

    scores: (..., n) importance scores, larger = more important (negative values count as 0).
    expected_count: expected retained tokens per row (a count: ``retained_count(budget, n)`` for a budget
    fraction); raised to n_sink + n_recent.
    π = 1 on the first n_sink and last n_recent tokens and on the top ``head_fraction`` of the remaining
    count by score; the other (tail) tokens get π ∝ score, capped at 1, floored at pi_min, with Σπ over
    the row equal to the expected count. If the floor alone would exceed the tail's share, the tail is
    uniform at share/|tail|. expected_count >= n gives all ones. Returns (..., n) float32 in (0, 1].
    certain: (..., n) bool, the slots kept with π = 1 instead of the sinks and recent window (an allocator's
    pool: kvcert.allocators), the same number in every row; the expected count is then raised to it.

    The two defenses of the certificate (both 0: the design above):
    tail_mix (λ in [0, 1]): the tail's π become (1 − λ)·π + λ·m_tail/|tail|, m_tail the tail's expected count, so
    Σπ and the head are unchanged and every tail π >= λ·m_tail/|tail| (both terms are at most 1, so is the mix).
    head_attention_share (η in [0, 1]) with attention ((..., n), the observation window's attention per token and
    row, larger = attended more: ``kvcert.designs.window_attention_mass``): of the top slice's n_top slots,
    floor(η·n_top) go to the non-certain tokens attended most (ties by position), the rest to the highest scores
    among the tokens not chosen yet; the slice keeps its count.
    """
    if scores.ndim == 0:
        raise ValueError("scores must have at least one dimension (..., n)")
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN")
    if not 0.0 <= head_fraction <= 1.0:
        raise ValueError(f"head_fraction={head_fraction} must lie in [0, 1]")
    if not 0.0 < pi_min <= 1.0:
        raise ValueError(f"pi_min={pi_min} must lie in (0, 1]")
    check_defenses(tail_mix, head_attention_share)
    n = scores.shape[-1]
    if certain is None:
        floor = minimum_count(n, n_sink, n_recent)
    else:
        if certain.shape != scores.shape:
            raise ValueError(f"certain {tuple(certain.shape)} must have the scores' shape {tuple(scores.shape)}")
        per_row = certain.reshape(-1, n).sum(-1)
        if bool((per_row != per_row[0]).any()):
            raise ValueError("certain must hold the same number of slots in every row")
        floor = int(per_row[0])
    count = max(float(expected_count), float(floor))
    if count >= n:
        return torch.ones_like(scores, dtype=torch.float32)

    flat = scores.reshape(-1, n).to(torch.float64)
    rows = flat.shape[0]
    if certain is None:
        certain = certain_mask(n, n_sink, n_recent, scores.device).expand(rows, n)
    else:
        certain = certain.reshape(rows, n)
    n_certain = int(certain[0].sum())
    n_top = int(head_fraction * (count - n_certain))
    n_attended = int(head_attention_share * n_top)
    # Top slice by score among the non-certain tokens (ties broken by position, deterministically).
    ranked = torch.where(certain, torch.full_like(flat, float("-inf")), flat)
    top = torch.zeros_like(certain)
    if n_attended > 0:  # the attention's share first, then the scores' among the tokens not chosen yet
        if attention is None or attention.shape != scores.shape:
            raise ValueError(f"head_attention_share={head_attention_share} needs the window's attention of the "
                             f"scores' shape {tuple(scores.shape)}; got "
                             f"{None if attention is None else tuple(attention.shape)}")
        attended = torch.where(certain, torch.full_like(flat, float("-inf")),
                               attention.reshape(rows, n).to(torch.float64))
        idx = torch.argsort(-attended, dim=-1, stable=True)[:, :n_attended]
        top.scatter_(-1, idx, True)
        ranked = torch.where(top, torch.full_like(ranked, float("-inf")), ranked)
    if n_top - n_attended > 0:
        idx = torch.topk(ranked, n_top - n_attended, dim=-1, sorted=False).indices
        top.scatter_(-1, idx, True)
    head = certain | top
    tail = ~head
    n_tail = float(n - n_certain - n_top)
    target = torch.full((rows,), count - n_certain - n_top, dtype=torch.float64, device=scores.device)
    if pi_min * n_tail >= float(target[0]):
        pi_tail = torch.where(tail, target.unsqueeze(-1) / n_tail, torch.zeros_like(flat))
    else:
        pi_tail = _water_fill(flat, tail, target, pi_min)
    if tail_mix > 0:
        pi_tail = mix_tail(pi_tail, tail, target / n_tail, tail_mix)
    pi = torch.where(head, torch.ones_like(flat), pi_tail)
    return pi.to(torch.float32).reshape(scores.shape)


def exact_water_fill(scores: torch.Tensor, tail: torch.Tensor, target: torch.Tensor, pi_min: float,
                     ascending: torch.Tensor | None = None) -> torch.Tensor:
    """``_water_fill`` solved exactly instead of by 100 bisection steps: the same π.

    scores: (R, n) float64; tail: (R, n) bool; target: (R,) float64 with pi_min·|tail| < target < |tail|;
    ascending: (R, n) the tail's scores clamped at 0 in ascending order, +inf after them (sorted here if None).
    Σ_tail clip(c·s, pi_min, 1) is continuous, non-decreasing and piecewise linear in c, with breakpoints
    pi_min/s_i (s_i leaves the floor) and 1/s_i (s_i reaches the cap): the totals at the breakpoints come from
    the sorted tail's prefix sums, the piece holding the target is bracketed by the nearest breakpoints on both
    sides, and on it the level solves a linear equation. The scores get _water_fill's perturbation (strictly
    positive, ties split by 1e-9 of the row's maximum), so both give one π. Returns (R, n) float64, zero off the
    tail.
    """
    rows, n = scores.shape
    if ascending is None:
        ascending = torch.sort(torch.where(tail, scores.clamp_min(0.0), torch.full_like(scores, float("inf"))),
                               dim=-1).values
    size = tail.sum(-1, keepdim=True)  # |tail|: the finite entries of ``ascending`` come first
    last = ascending.gather(-1, (size - 1).clamp_min(0))
    row_max = torch.where(size > 0, last, torch.zeros_like(last)).clamp_min(0.0)  # _water_fill's max over the tail
    shift = 1e-9 * row_max + 1e-300
    s = scores.clamp_min(0.0) + shift
    ascending = ascending + shift  # the perturbation keeps the order
    finite = torch.where(torch.isfinite(ascending), ascending, torch.zeros_like(ascending))
    prefix = torch.cat([torch.zeros_like(finite[:, :1]), finite.cumsum(-1)], dim=-1)  # (R, n + 1)

    def pieces(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """At levels c (R, k): (capped count, floored count, Σ s of the tokens between floor and cap)."""
        floored = torch.minimum(torch.searchsorted(ascending, pi_min / c, right=True), size)
        below_cap = torch.minimum(torch.searchsorted(ascending, 1.0 / c, right=False), size)
        return size - below_cap, floored, prefix.gather(-1, below_cap) - prefix.gather(-1, floored)

    def total(c: torch.Tensor) -> torch.Tensor:
        capped, floored, middle = pieces(c)
        return capped + c * middle + pi_min * floored

    goal = target.unsqueeze(-1)
    low = torch.zeros_like(goal)
    high = torch.full_like(goal, float("inf"))
    # two sorted sequences of breakpoints (descending along the row; +inf entries give c = 0, all floored): in
    # each, those whose total is <= target form a suffix. The nearest on either side of the target bracket its
    # piece, which holds no other breakpoint.
    for c in (pi_min / ascending, 1.0 / ascending):
        above = (total(c) > goal).sum(-1, keepdim=True)  # the suffix starts here
        low = torch.maximum(low, c.gather(-1, above.clamp_max(n - 1)).where(above < n, torch.zeros_like(low)))
        nearest_above = c.gather(-1, (above - 1).clamp_min(0))
        high = torch.minimum(high, nearest_above.where(above > 0, torch.full_like(high, float("inf"))))
    capped, floored, middle = pieces(0.5 * (low + high))
    level = (goal - capped - pi_min * floored) / middle.clamp_min(1e-300)
    pi = (s * level).clamp(pi_min, 1.0)
    return torch.where(tail, pi, torch.zeros_like(pi))


@dataclass(frozen=True)
class Ranking:
    """What a row's π needs that its count does not change, computed once per search.

    rank: (R, n) long, the rank among the non-certain tokens by score (stable: ties by position), n for certain
    ones; ascending: (R, n) float64, the non-certain scores clamped at 0 in ascending order, +inf after them;
    free: the number of non-certain tokens (the same in every row)."""

    rank: torch.Tensor
    ascending: torch.Tensor
    free: int


def rank_scores(flat: torch.Tensor, certain: torch.Tensor) -> Ranking:
    """The Ranking of rows ``flat`` (R, n) float64 scores (or attention), ``certain`` (R, n) bool their certain slots."""
    rows, n = flat.shape
    ranked = torch.where(certain, torch.full_like(flat, float("-inf")), flat.clamp_min(0.0))
    order = torch.argsort(-ranked, dim=-1, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=flat.device).expand(rows, n))
    free = n - int(certain[0].sum())
    descending = ranked.gather(-1, order)[:, :free]
    ascending = torch.cat([descending.flip(-1), torch.full_like(flat[:, free:], float("inf"))], dim=-1)
    return Ranking(torch.where(certain, torch.full_like(rank, n), rank), ascending, free)


def row_inclusion_probabilities(scores: torch.Tensor, counts: torch.Tensor, *, n_sink: int = DESIGN.n_sink,
                                n_recent: int = DESIGN.n_recent, head_fraction: float = DESIGN.head_fraction,
                                pi_min: float = DESIGN.pi_min, tail_mix: float = DESIGN.tail_mix,
                                head_attention_share: float = DESIGN.head_attention_share,
                                ranking: Ranking | None = None, attention: torch.Tensor | None = None,
                                attention_ranking: Ranking | None = None) -> torch.Tensor:
    """``inclusion_probabilities`` with one expected count per row, every row solved at once (a target's search
    calls it once per bisection step for a whole model's rows).

    scores: (..., n) importance; counts: (...) integer expected counts (raised to sinks + recent window); the
    design's keywords as ``inclusion_probabilities`` takes them (the certain slots are the sinks and recent window);
    ranking: the rows' ``rank_scores`` when already computed (it does not depend on the counts).
    The defenses as there: ``tail_mix`` mixes the tail with a uniform share; ``head_attention_share`` gives
    floor(η·n_top) of each row's top slice to the tokens ``attention`` ((..., n), the window's attention) ranks
    highest, the rest to the highest scores not chosen yet (attention_ranking: its ``rank_scores``, if computed).
    Returns (..., n) float64 π: for every row, what inclusion_probabilities(row, count) gives, the tail's level
    solved exactly (``exact_water_fill``) and the top slice's ties broken by position. tests/test_targets.py and
    tests/test_defenses.py check the two agree row by row.
    """
    check_defenses(tail_mix, head_attention_share)
    n = scores.shape[-1]
    flat = scores.reshape(-1, n).to(torch.float64)
    rows = flat.shape[0]
    count = counts.reshape(rows).to(torch.float64).clamp_min(minimum_count(n, n_sink, n_recent))
    certain = certain_mask(n, n_sink, n_recent, scores.device).expand(rows, n)
    ranking = ranking if ranking is not None else rank_scores(flat, certain)
    n_certain = n - ranking.free
    n_top = torch.floor(head_fraction * (count - n_certain)).clamp_min(0)  # int() of a non-negative number
    n_attended = torch.floor(head_attention_share * n_top)
    if bool((n_attended > 0).any()):  # the attention's share of the slice first, then the scores' skipping those
        if attention is None:
            raise ValueError(f"head_attention_share={head_attention_share} needs the window's attention")
        if attention_ranking is None:
            attention_ranking = rank_scores(attention.reshape(rows, n).to(torch.float64), certain)
        attended = attention_ranking.rank < n_attended.unsqueeze(-1)
        # each token's place in the score order among the tokens the attention did not choose
        in_order = torch.zeros((rows, n + 1), dtype=torch.long, device=scores.device)
        in_order.scatter_(-1, ranking.rank, attended.long())  # certain tokens (rank n) land in the spare column
        before = (in_order.cumsum(-1) - in_order).gather(-1, ranking.rank)
        by_score = ~attended & (ranking.rank - before < (n_top - n_attended).unsqueeze(-1))
        head = certain | attended | by_score
        ascending = None  # the tail is no longer the scores' bottom: exact_water_fill sorts it
    else:
        head = certain | (ranking.rank < n_top.unsqueeze(-1))
        # the tail's sorted scores: the non-certain ones without the top slice, i.e. without the largest n_top
        kept = torch.arange(n, device=scores.device) < (ranking.free - n_top).unsqueeze(-1)
        ascending = torch.where(kept, ranking.ascending, torch.full_like(flat, float("inf")))
    tail = ~head
    n_tail = (n - n_certain - n_top).clamp_min(1.0)
    share = count - n_certain - n_top
    uniform = (pi_min * n_tail >= share).unsqueeze(-1)
    filled = exact_water_fill(flat, tail, share, pi_min, ascending)
    pi_tail = torch.where(uniform, (share / n_tail).unsqueeze(-1).expand(rows, n), filled)
    if tail_mix > 0:
        pi_tail = mix_tail(torch.where(tail, pi_tail, torch.zeros_like(pi_tail)), tail, share / n_tail,
                           tail_mix)
    pi = torch.where(head, torch.ones_like(flat), torch.where(tail, pi_tail, torch.zeros_like(flat)))
    pi = torch.where((count >= n).unsqueeze(-1), torch.ones_like(pi), pi)
    return pi.reshape(scores.shape)


def check_defenses(tail_mix: float, head_attention_share: float) -> None:
    """One ValueError line for a defense outside [0, 1] (``design_options.tail_mix`` / ``head_attention_share``)."""
    for name, value in (("tail_mix", tail_mix), ("head_attention_share", head_attention_share)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"design_options.{name}={value!r} must lie in [0, 1]")


def mix_tail(pi_tail: torch.Tensor, tail: torch.Tensor, uniform: torch.Tensor, tail_mix: float) -> torch.Tensor:
    """The defensive tail: (1 − λ)·π + λ·u on the tail, 0 elsewhere.

    pi_tail: (R, n) float64, the tail's π (0 off it); tail: (R, n) bool; uniform: (R,) float64, the tail's
    expected count over its size; tail_mix: λ in [0, 1]. Returns (R, n) float64 with the same row sums over the tail.
    """
    mixed = (1.0 - tail_mix) * pi_tail + tail_mix * uniform.unsqueeze(-1)
    return torch.where(tail, mixed, torch.zeros_like(mixed))


def poisson_sample(pi: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Independent Bernoulli(π_i) draws: (..., n) float in [0, 1] -> (..., n) bool (π = 1 always kept); no
    generator: one seeded 0 on π's device (kvcert.seeding)."""
    if bool(((pi < 0) | (pi > 1) | torch.isnan(pi)).any()):
        raise ValueError("inclusion probabilities must lie in [0, 1]")
    u = torch.rand(pi.shape, generator=generator_or_seeded_zero(generator, pi.device), device=pi.device,
                   dtype=torch.float64)
    pi = pi.to(torch.float64)
    keep = u < pi
    records = _DRAW_RECORDS.get()
    if records is not None:  # only inside ``recording_draws``; the draw itself is the same either way
        kept = hashlib.sha256(keep.cpu().numpy().tobytes()).hexdigest()
        records.append((draw_margin(u, pi), kept))
    return keep


# (draw margin, digest of the kept mask) of each poisson_sample call made inside ``recording_draws`` (None: not
# recording).
_DRAW_RECORDS: ContextVar[list | None] = ContextVar("draw_records", default=None)


def draw_margin(u: torch.Tensor, pi: torch.Tensor) -> float:
    """How close one Poisson sample came to another outcome: min |u − π| / π over its sampled slots (0 < π < 1).

    u, pi: (..., n) float64, the uniform draws and the inclusion probabilities they were compared with (kept iff
    u < π). A slot whose π moved by this relative amount (e.g. scores rounded differently on another CPU) could
    be kept where it was dropped or the reverse; slots with π = 1 (the certain head) cannot flip. inf when no slot
    was sampled."""
    sampled = (pi > 0) & (pi < 1)
    if not bool(sampled.any()):
        return float("inf")
    return float(((u - pi).abs() / pi)[sampled].min())


@contextmanager
def recording_draws() -> Iterator[list[tuple[float, str]]]:
    """Collect, for every ``poisson_sample`` call made inside, in call order, (``draw_margin``, the sha256 of
    the kept mask's bytes): how close the sample came to another outcome, and which one it was."""
    token = _DRAW_RECORDS.set([])
    try:
        yield _DRAW_RECORDS.get()
    finally:
        _DRAW_RECORDS.reset(token)


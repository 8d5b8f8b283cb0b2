"""Inclusion probabilities for the randomized design, and Poisson sampling (docs/METHOD.md §2).

A row of n cached tokens is split into a certainty head (π = 1: attention sinks, the most recent window
and a top slice of the score ranking) and a tail whose tokens are kept independently with π ∝ score,
capped at 1 and floored at ``pi_min``, scaled so that Σπ over the row equals the expected retained count.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from contextvars import ContextVar
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


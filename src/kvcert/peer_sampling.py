"""The peers' decode-time sampler: a CLT-sized, with-replacement importance sample that keeps the full cache.

Built from the published description of verified sparse attention (vAttention, arXiv 2510.05688) and of the
variance-adaptive importance-sampling press of its authors' kvpress fork (no code of theirs is used): at each
decode step, with the real query,

1. sinks (the first ``n_sink`` tokens), the local window (the last ``n_recent``) and the ``n_top`` largest logits
   of the rest are kept exactly;
2. the rest R is sampled with replacement from a proposal s (normalized over R; uniform where the proposal has
   no mass): first a pilot of ``pilot`` draws, from which x_t = w_{i_t}/s_{i_t} (w = exp(logit − max)) gives
   D̂ = mean x and M̂₂ = mean x²;
3. the sample size is the CLT bound m = ⌈z² (M̂₂ − D̂²) / (ε² D̂²)⌉, z = Φ⁻¹(1 − δ/2) (two-sided), raised to the
   pilot and capped at ``max_draws``; the extra m − pilot draws are added to the pilot's;
4. a drawn token i with count c_i carries the logit bias log(c_i / (m s_i)), so that softmax attention over the
   kept and drawn tokens is the ratio of the Hansen–Hurwitz estimates
   ô = (Σ_K w v + (1/m) Σ_t (w/s) v) / (Σ_K w + (1/m) Σ_t w/s).

The bound is on the relative error of the estimate of R's softmax denominator, as the press states it. Because
the draw is redone for every query, the whole cache stays in memory: this is a baseline for accuracy and
error, not for memory.

``DecodeSampler`` runs it inside generation (design ``clt``, ``kvcert.generation``): a row of the decode batch
keeps every slot, and its attention output is replaced, per layer, KV head and query, by the sampler's estimate.
Its proposal is the policy's prefill scores mixed with a uniform share (a defensive mixture, so that every token
of R can be drawn), its draws per query capped at the context's token count (``kvcert.generation.clt_selections``:
past it, attending to every token costs less than sampling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from .seeding import generator_or_seeded_zero


@dataclass(frozen=True)
class CLTOptions:
    """The decode-time sampler's knobs: the target (epsilon, delta), the exactly kept sinks and window (the
    designs' n_sink / n_recent), the top logits kept exactly, the pilot size, the uniform share of the proposal
    and the cap on draws per query (max_fraction × context tokens; None: no cap)."""

    epsilon: float
    delta: float
    n_sink: int = 4
    n_recent: int = 32
    n_top: int = 0
    pilot: int = 32
    uniform_share: float = 0.1
    max_fraction: float | None = None

    def __post_init__(self):
        check_epsilon_delta(self.epsilon, self.delta)
        if not 0.0 <= self.uniform_share <= 1.0:
            raise ValueError(f"uniform_share={self.uniform_share!r}: must lie in [0, 1]")


@dataclass(frozen=True)
class CLTSample:
    """One query's sample and output.

    out: (dv,) the estimate of attention; bias: (n,) the logit bias per slot (0 kept exactly, log(c/(m s)) drawn,
    −inf neither); kept: (k,) long positions kept exactly; draws: (m,) long positions drawn with replacement
    (pilot first); pilot_moments: (D̂, M̂₂) of the pilot; size: m, the number of draws used.
    """

    out: torch.Tensor
    bias: torch.Tensor
    kept: torch.Tensor
    draws: torch.Tensor
    pilot_moments: tuple[float, float]
    size: int


def check_epsilon_delta(epsilon: float, delta: float) -> None:
    """One line for a bad target: ε must be > 0, δ must lie in (0, 1)."""
    if not epsilon > 0:
        raise ValueError(f"epsilon={epsilon!r}: must be > 0")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta!r}: must lie in (0, 1)")


def clt_bound(mean: torch.Tensor, second: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """The CLT sample size ⌈z² (M̂₂ − D̂²) / (ε² D̂²)⌉ per row, z = Φ⁻¹(1 − δ/2), from the pilot's moments
    mean = D̂ and second = M̂₂ (r,), in their dtype (not rounded to integers' type); 0 where D̂ ≤ 0."""
    z = NormalDist().inv_cdf(1.0 - delta / 2.0)
    variance = (second - mean * mean).clamp_min(0.0)
    bound = torch.ceil(z * z * variance / (epsilon * epsilon * mean.square()).clamp_min(torch.finfo(mean.dtype).tiny))
    return torch.where(mean > 0, bound, torch.zeros_like(bound))


def clt_sample_size(x: torch.Tensor, epsilon: float, delta: float) -> int:
    """``clt_bound`` of one pilot's (m0,) ratios x = w/s, in float64."""
    check_epsilon_delta(epsilon, delta)
    x = x.to(torch.float64)
    return int(clt_bound(x.mean().reshape(1), x.square().mean().reshape(1), epsilon, delta)[0])


def clt_weights(logits: torch.Tensor, allowed: torch.Tensor, exact: torch.Tensor, proposal: torch.Tensor, *,
                epsilon: float, delta: float, pilot: int = 32, max_draws: int | torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """The sampler on r query rows at once: (weights, sizes, moments, draws).

    logits: (r, n) scaled logits (any value where not ``allowed``); allowed: (r, n) bool, the slots the query may
    see (causal, window, padding); exact: (r, n) bool, kept exactly (only where allowed); proposal: (r, n)
    non-negative sampling weights, normalized over each row's rest R = allowed & ~exact (uniform over R where it has
    no mass there); max_draws: an int or (r,) per-row cap on m (None: no cap). Returns weights (r, n), the
    un-normalized attention weights of the estimate, w on exact slots and c w / (m s) on drawn ones, 0 elsewhere
    (so out = weights @ v / weights.sum()); sizes (r,) long, m per row (0 where R is empty); moments (r, 2), the
    pilot's (D̂, M̂₂); draws (r, max m) long positions drawn, pilot first, −1 past each row's m. Float64 when
    ``logits`` is, else float32.
    """
    check_epsilon_delta(epsilon, delta)
    if pilot < 1:
        raise ValueError(f"pilot={pilot}: must be >= 1")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    r, n = logits.shape
    exact = exact & allowed
    rest = allowed & ~exact
    masked = torch.where(allowed, logits.to(dtype), torch.full((), float("-inf"), dtype=dtype, device=logits.device))
    top = masked.amax(-1, keepdim=True)
    w = torch.where(allowed, torch.exp(masked - torch.where(torch.isfinite(top), top, torch.zeros_like(top))),
                    torch.zeros_like(masked))
    s = torch.where(rest, proposal.to(dtype).clamp_min(0.0), torch.zeros_like(w))
    mass = s.sum(-1, keepdim=True)
    uniform = rest.to(dtype) / rest.sum(-1, keepdim=True).clamp_min(1)
    s = torch.where(mass > 0, s / mass.clamp_min(torch.finfo(dtype).tiny), uniform)
    sampled = rest.any(-1)  # (r,)
    # rows with nothing to sample draw from a placeholder distribution; their draws are discarded
    law = torch.where(sampled.unsqueeze(-1), s, torch.full_like(s, 1.0 / n))
    generator = generator_or_seeded_zero(generator)  # the pilot's and the rest's draws, from one generator
    first = torch.multinomial(law.cpu().float(), pilot, replacement=True, generator=generator).to(logits.device)
    x = w.gather(-1, first) / law.gather(-1, first)
    mean, second = x.mean(-1), x.square().mean(-1)
    bound = clt_bound(mean, second, epsilon, delta)
    sizes = torch.maximum(bound, torch.full_like(bound, float(pilot)))
    if max_draws is not None:
        cap = torch.as_tensor(max_draws, dtype=dtype, device=logits.device).expand(r)
        sizes = torch.maximum(torch.minimum(sizes, cap), torch.full_like(sizes, float(pilot)))
    sizes = torch.where(sampled, sizes, torch.zeros_like(sizes)).to(torch.long)
    longest = int(sizes.max()) if r else 0
    extra = longest - pilot
    draws = first if extra <= 0 else torch.cat(
        [first, torch.multinomial(law.cpu().float(), extra, replacement=True, generator=generator).to(logits.device)],
        dim=-1)
    used = torch.arange(draws.shape[-1], device=logits.device) < sizes.unsqueeze(-1)
    draws = torch.where(used, draws, torch.full_like(draws, -1))[:, : max(longest, 0)]
    used = used[:, : draws.shape[-1]]
    counts = torch.zeros_like(w).scatter_add_(-1, draws.clamp_min(0), used.to(dtype))
    drawn_weight = counts * w / (sizes.clamp_min(1).unsqueeze(-1).to(dtype) * s.clamp_min(torch.finfo(dtype).tiny))
    weights = torch.where(exact, w, torch.where(rest, drawn_weight, torch.zeros_like(w)))
    return weights, sizes, torch.stack([mean, second], -1), draws


def clt_importance_attention(logits: torch.Tensor, values: torch.Tensor, proposal: torch.Tensor, *, epsilon: float,
                             delta: float, n_sink: int = 4, n_recent: int = 32, n_top: int = 0, pilot: int = 32,
                             max_draws: int | None = None,
                             generator: torch.Generator | None = None) -> CLTSample:
    """The sampler on one head and one query, the last position (see the module's docstring; ``clt_weights`` does
    the work).

    logits: (n,) scaled attention logits of the query over the cache; values: (n, dv); proposal: (n,)
    non-negative sampling weights (only R's are used). Computed in float64 when any input is, else float32.
    """
    if logits.ndim != 1 or values.ndim != 2 or values.shape[0] != logits.shape[0] or proposal.shape != logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, values {tuple(values.shape)} and proposal "
                         f"{tuple(proposal.shape)} must be (n,), (n, dv), (n,)")
    dtype = torch.float64 if torch.float64 in (logits.dtype, values.dtype, proposal.dtype) else torch.float32
    n = logits.shape[0]
    exact = exact_slots(logits.to(dtype)[None], torch.arange(n, device=logits.device)[None],
                        torch.ones(1, n, dtype=torch.bool, device=logits.device), n - 1, n_sink=n_sink,
                        n_recent=n_recent, n_top=n_top)
    weights, sizes, moments, draws = clt_weights(
        logits.to(dtype)[None], torch.ones_like(exact), exact, proposal.to(dtype)[None], epsilon=epsilon, delta=delta,
        pilot=pilot, max_draws=max_draws, generator=generator)
    weights, size = weights[0], int(sizes[0])
    out = (weights @ values.to(dtype)) / weights.sum()
    bias = torch.where(weights > 0, torch.log(weights) - (logits.to(dtype) - logits.to(dtype).max()),
                       torch.full_like(weights, float("-inf")))
    bias = torch.where(exact[0], torch.zeros_like(bias), bias)
    pos = torch.arange(n, device=logits.device)
    return CLTSample(out=out, bias=bias, kept=pos[exact[0]], draws=draws[0, :size],
                     pilot_moments=(float(moments[0, 0]), float(moments[0, 1])), size=size)


def exact_slots(logits: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, query_position, *, n_sink: int,
                n_recent: int, n_top: int) -> torch.Tensor:
    """(r, n) bool: the slots kept exactly for r query rows: the first ``n_sink`` positions, the ``n_recent`` up to
    the query's own position (``query_position``: an int or (r,)), and the ``n_top`` largest logits of the others,
    among ``allowed`` slots. logits, positions, allowed: (r, n)."""
    q_pos = torch.as_tensor(query_position, device=positions.device).reshape(-1, 1)
    exact = allowed & ((positions < n_sink) | (positions > q_pos - n_recent))
    if n_top > 0:
        others = allowed & ~exact
        ranked = torch.where(others, logits, torch.full_like(logits, float("-inf")))
        k = min(n_top, logits.shape[-1])
        top = torch.topk(ranked, k, dim=-1, sorted=False).indices
        picked = torch.zeros_like(exact).scatter_(-1, top, True) & others
        exact = exact | picked
    return exact


@dataclass
class DecodeSampler:
    """One layer of one decode row under the sampler: its options, its proposal (kv_heads, n_prefix) float32 (the
    policy's prefill scores of the layer, non-negative) and the row's generator (shared by the row's layers, so a
    seed reproduces the row)."""

    options: CLTOptions
    proposal: torch.Tensor
    generator: torch.Generator
    context_tokens: int

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               allowed: torch.Tensor, query_positions: torch.Tensor, scale: float) -> torch.Tensor:
        """The sampler's attention output for one batch row, (kv_heads, R, dv) float32.

        queries: (kv_heads, R, d) grouped query rows; keys/values: (kv_heads, S, d|dv) the row's slots;
        positions: (kv_heads, S) long, the slots' token positions; allowed: (kv_heads, R, S) bool (causal, window,
        padding); query_positions: (kv_heads, R) long, each row's token position.
        """
        o = self.options
        hk, rows, _ = queries.shape
        n = self.proposal.shape[-1]
        logits = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scale  # (hk, R, S)
        prefix = positions < n
        score = self.proposal.float().gather(-1, positions.clamp_max(n - 1))  # (hk, S)
        mean = self.proposal.float().mean(-1, keepdim=True)
        score = torch.where(prefix, score, mean).clamp_min(0.0)
        score = score / score.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        proposal = (1.0 - o.uniform_share) * score + o.uniform_share / score.shape[-1]
        flat_pos = positions.unsqueeze(1).expand(hk, rows, -1).reshape(hk * rows, -1)
        flat_logits, flat_allowed = logits.reshape(hk * rows, -1), allowed.reshape(hk * rows, -1)
        exact = exact_slots(flat_logits, flat_pos, flat_allowed, query_positions.reshape(-1), n_sink=o.n_sink,
                            n_recent=o.n_recent, n_top=o.n_top)
        cap = None if o.max_fraction is None else max(o.pilot, math.ceil(o.max_fraction * self.context_tokens))
        weights, _, _, _ = clt_weights(flat_logits, flat_allowed, exact,
                                       proposal.unsqueeze(1).expand(hk, rows, -1).reshape(hk * rows, -1),
                                       epsilon=o.epsilon, delta=o.delta, pilot=o.pilot, max_draws=cap,
                                       generator=self.generator)
        weights = weights.reshape(hk, rows, -1)
        return torch.matmul(weights, values.float()) / weights.sum(-1, keepdim=True)


__all__ = ["CLTOptions", "CLTSample", "DecodeSampler", "check_epsilon_delta", "clt_bound", "clt_importance_attention",
           "clt_sample_size", "clt_weights", "exact_slots"]

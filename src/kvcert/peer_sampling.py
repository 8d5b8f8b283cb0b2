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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch


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


def clt_sample_size(x: torch.Tensor, epsilon: float, delta: float) -> int:
    """⌈z² (M̂₂ − D̂²) / (ε² D̂²)⌉ from the pilot's (m0,) ratios x = w/s, z = Φ⁻¹(1 − δ/2); 0 if D̂ = 0."""
    if not epsilon > 0:
        raise ValueError(f"epsilon={epsilon!r}: must be > 0")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta!r}: must lie in (0, 1)")
    x = x.to(torch.float64)
    mean, second = float(x.mean()), float(x.square().mean())
    if mean <= 0:
        return 0
    z = NormalDist().inv_cdf(1.0 - delta / 2.0)
    return int(math.ceil(z * z * max(second - mean * mean, 0.0) / (epsilon * epsilon * mean * mean)))


def clt_importance_attention(logits: torch.Tensor, values: torch.Tensor, proposal: torch.Tensor, *, epsilon: float,
                             delta: float, n_sink: int = 4, n_recent: int = 32, n_top: int = 0, pilot: int = 32,
                             max_draws: int | None = None,
                             generator: torch.Generator | None = None) -> CLTSample:
    """The sampler on one head and one query (see the module's docstring).

    logits: (n,) scaled attention logits of the query over the cache; values: (n, dv); proposal: (n,)
    non-negative sampling weights (only R's are used). Computed in float64 when any input is, else float32.
    """
    if logits.ndim != 1 or values.ndim != 2 or values.shape[0] != logits.shape[0] or proposal.shape != logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, values {tuple(values.shape)} and proposal "
                         f"{tuple(proposal.shape)} must be (n,), (n, dv), (n,)")
    if pilot < 1:
        raise ValueError(f"pilot={pilot}: must be >= 1")
    dtype = torch.float64 if torch.float64 in (logits.dtype, values.dtype, proposal.dtype) else torch.float32
    logits, values, proposal = logits.to(dtype), values.to(dtype), proposal.to(dtype).clamp_min(0.0)
    n = logits.shape[0]
    pos = torch.arange(n, device=logits.device)
    exact = (pos < n_sink) | (pos >= n - n_recent)
    if n_top > 0:
        ranked = torch.where(exact, torch.full_like(logits, float("-inf")), logits)
        top = torch.topk(ranked, min(n_top, int((~exact).sum())), sorted=False).indices
        exact[top] = True
    rest = ~exact
    bias = torch.where(exact, torch.zeros_like(logits), torch.full_like(logits, float("-inf")))
    draws = torch.zeros(0, dtype=torch.long, device=logits.device)
    moments, size = (0.0, 0.0), 0
    if bool(rest.any()):
        s = torch.where(rest, proposal, torch.zeros_like(proposal))
        s = s / s.sum() if float(s.sum()) > 0 else rest.to(dtype) / rest.sum()
        w = torch.exp(logits - logits.max())
        first = torch.multinomial(s.cpu(), pilot, replacement=True, generator=generator).to(logits.device)
        x = w[first] / s[first]
        moments = (float(x.mean()), float(x.square().mean()))
        size = max(pilot, clt_sample_size(x, epsilon, delta))
        if max_draws is not None:
            size = max(pilot, min(size, int(max_draws)))
        extra = torch.multinomial(s.cpu(), size - pilot, replacement=True, generator=generator).to(logits.device) \
            if size > pilot else first[:0]
        draws = torch.cat([first, extra])
        counts = torch.bincount(draws, minlength=n).to(dtype)
        drawn = counts > 0
        bias = torch.where(drawn, torch.log(counts / (size * s)), bias)
    weights = torch.softmax(logits + bias, dim=-1)
    return CLTSample(out=weights @ values, bias=bias, kept=pos[exact], draws=draws, pilot_moments=moments, size=size)


__all__ = ["CLTSample", "clt_importance_attention", "clt_sample_size"]

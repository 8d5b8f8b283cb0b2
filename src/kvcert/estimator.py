"""The Hájek attention estimator and its linearized Poisson-sampling variance (DESIGN §1).

Over a retained set S with inclusion probabilities π, attention with the logit offset −log π_i is the
Hájek (ratio) estimator of full attention:

    ô = Σ_{i∈S} (w_i/π_i) v_i / Σ_{i∈S} (w_i/π_i),      w_i = exp(q·k_i · scale).

Its linearized variance under Poisson sampling, per output coordinate j, with a_i the softmax weights of
the offset logits, is

    V̂_j = Σ_{i∈S} (1 − π_i) a_i² (v_ij − ô_j)².

Certain tokens (π = 1) contribute nothing. Everything here is computed in float32 (float64 when the
inputs are float64) whatever the input dtype, so a bf16 model still gets a float32 certificate.
"""

from __future__ import annotations

import math

import torch

NOT_RETAINED = float("-inf")


class EmptyRetainedSetError(ValueError):
    """An attention row has no retained slot: the estimator is undefined there."""


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def offset_bias(log_pi: torch.Tensor) -> torch.Tensor:
    """The additive logit bias −log π, with −inf for slots that are not retained.

    log_pi: (..., n), 0 for certain tokens, log π ∈ (−inf, 0) for sampled ones, −inf for evicted/padding.
    Returns (..., n) in the same dtype.
    """
    return torch.where(torch.isfinite(log_pi), -log_pi, torch.full_like(log_pi, NOT_RETAINED))


def tail_weight(log_pi: torch.Tensor) -> torch.Tensor:
    """1 − π per slot: 0 for certain tokens, in (0, 1) for sampled ones, 1 for non-retained (weight 0 anyway)."""
    return -torch.expm1(log_pi)


def hajek_with_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    one_minus_pi: torch.Tensor | None,
    scale: float,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
    check_empty: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hájek output and per-coordinate variance for arbitrary additive logit biases.

    q: (..., m, d); k: (..., n, d); v: (..., n, dv); bias: broadcastable to (..., m, n), holding −log π plus
    any −inf mask (causal, sliding window, non-retained); one_minus_pi: broadcastable to (..., m, n) or None
    when no variance is wanted; bias may be None (no mask, no offset). moments: optional precomputed
    ``value_moments(v[..., :k, :])`` when only the first k slots can have π < 1 (a compressed cache whose
    later slots are certain appended tokens); one_minus_pi then covers those k slots only, and the variance
    is reduced over them without touching the other slots.
    Returns out (..., m, dv) and var (..., m, dv) or None, in float32/float64.
    Raises EmptyRetainedSetError if some row has no finite logit (check_empty=False skips the check, for
    callers whose rows cannot be empty: it costs a device synchronization per call).
    """
    dtype = compute_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias.to(dtype)
    if check_empty and not bool(torch.isfinite(logits.amax(dim=-1)).all()):
        raise EmptyRetainedSetError("an attention row has no retained slot (all logits are -inf or NaN)")
    weights = torch.softmax(logits, dim=-1)
    out = torch.matmul(weights, v)
    if one_minus_pi is None:
        return out, None
    center, stacked = value_moments(v) if moments is None else moments
    c = weights[..., : stacked.shape[-2]].square() * one_minus_pi.to(dtype)
    dv = v.shape[-1]
    sums = torch.matmul(c, stacked)  # Σc(v−μ)², Σc(v−μ), Σc in one reduction
    oc = out - center
    var = sums[..., :dv] - 2.0 * oc * sums[..., dv : 2 * dv] + oc.square() * sums[..., 2 * dv :]
    return out, var.clamp_min(0.0)


def value_moments(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(center, [(v − center)², v − center, 1]) for v (..., n, dv): center (..., 1, dv), stacked (..., n, 2dv+1).

    Centering on the mean over slots keeps the expanded variance Σc v² − 2ô Σc v + ô² Σc free of
    catastrophic cancellation without materializing an (m, n, dv) tensor; stacking lets one matmul
    produce all three sums.
    """
    center = v.mean(dim=-2, keepdim=True)
    vc = v - center
    return center, torch.cat([vc.square(), vc, torch.ones_like(vc[..., :1])], dim=-1)


def hajek_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_pi: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hájek-corrected attention over a Poisson-sampled retained set, with its linearized variance.

    q: (..., m, d) queries; k: (..., n, d) retained keys; v: (..., n, dv) retained values;
    log_pi: (..., n) with 0 for certain tokens, log π ∈ (−inf, 0) for sampled tail tokens and −inf for
    slots that are not retained. scale defaults to 1/sqrt(d).
    Returns out (..., m, dv), the Hájek estimate of full attention, and var (..., m, dv), the per-coordinate
    linearized variance Σ_tail (1−π_i) a_i² (v_i − out)², both float32 (float64 for float64 inputs).
    Raises EmptyRetainedSetError when a row has no retained slot, ValueError on NaN in log_pi.
    """
    if log_pi.shape[-1] != k.shape[-2] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"log_pi {tuple(log_pi.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree on n")
    if bool(torch.isnan(log_pi).any()):
        raise ValueError("log_pi contains NaN")
    if bool((log_pi > 0).any()):
        raise ValueError("log_pi must be <= 0 (log of a probability)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    log_pi = log_pi.to(compute_dtype(q, k, v)).unsqueeze(-2)
    return hajek_with_bias(q, k, v, offset_bias(log_pi), tail_weight(log_pi), scale)


def certificate(trace_var: torch.Tensor, delta: float = 0.05) -> torch.Tensor:
    """The (1−δ) Chebyshev bound on the error norm: ε̂_δ = sqrt(tr V̂ / δ). Same shape as trace_var."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta} must lie in (0, 1)")
    return torch.sqrt(trace_var.clamp_min(0.0) / delta)

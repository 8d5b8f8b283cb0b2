"""The Hájek attention estimator and its linearized Poisson-sampling variance (docs/METHOD.md §3-§4).

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

from .run_schema import DELTA
from .errors import EmptyRetainedSetError

NOT_RETAINED = float("-inf")
# Logits a certified call materializes at once (float32: 2 MB; its weights as many): a multi-token pass is split
# into row blocks of at most this many logits.
ROW_BLOCK_ELEMENTS = 1 << 19
# Keys (and values) of a bfloat16/float16 cache converted to float32 at once (4 MB), in at most MAX_CONVERT_BLOCKS
# blocks of the leading dimension: each block is one more call (about 20 operations) that a decode step pays in
# every layer, so a large layer (a 7B model's, on a GPU) is split in 4 and its float32 copy is a quarter of the
# layer's keys and values. Converting nothing (a bf16 matmul with float32 output, CUDA only) would remove both costs.
CONVERT_BLOCK_ELEMENTS = 1 << 20
MAX_CONVERT_BLOCKS = 4


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def offset_bias(log_pi: torch.Tensor) -> torch.Tensor:
    """The additive logit bias −log π, with −inf for slots that are not retained.

    log_pi: (..., n), 0 for certain tokens, log π ∈ (−inf, 0) for sampled ones, −inf for evicted/padding.
    Returns (..., n) in the same dtype.
    """
    return torch.where(torch.isfinite(log_pi), -log_pi, torch.full_like(log_pi, NOT_RETAINED))


def sampled_slots(log_pi: torch.Tensor) -> torch.Tensor:
    """Bool mask (..., n) of the retained slots that were sampled (0 < π < 1): the only ones with variance."""
    return (log_pi < 0) & torch.isfinite(log_pi)


def one_minus_pi(log_pi: torch.Tensor) -> torch.Tensor:
    """1 − π per slot, (..., n) from log π (..., n): 0 for certain tokens, in (0, 1) for sampled ones, 1 for
    non-retained slots (whose attention weight is 0 anyway). Computed as −expm1(log π) for accuracy near π = 1."""
    return -torch.expm1(log_pi)


def _smallest_kept(dtype: torch.dtype) -> float:
    """The largest subnormal of ``dtype``: terms at or below it are dropped (``torch.threshold`` keeps x > it)."""
    return float(torch.nextafter(torch.tensor(torch.finfo(dtype).tiny, dtype=dtype), torch.tensor(0.0, dtype=dtype)))


_SMALLEST_KEPT = {dtype: _smallest_kept(dtype) for dtype in (torch.float32, torch.float64)}


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b; a bare bmm for 3-d operands (matmul's reshapes around it cost as much as a decode step's bmm)."""
    return torch.bmm(a, b) if a.dim() == 3 and b.dim() == 3 else torch.matmul(a, b)


def hajek_with_weights(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float, check_empty: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hájek output and the softmax weights a of the offset logits, for arbitrary additive logit biases.

    q: (..., m, d); k: (..., n, d); v: (..., n, dv); bias: broadcastable to (..., m, n), holding −log π plus
    any −inf mask (causal, sliding window, non-retained), or None (no mask, no offset).
    Returns out (..., m, dv) and weights (..., m, n), float32 (float64 for float64 inputs).
    Raises EmptyRetainedSetError if some row has no finite logit (check_empty=False skips the check, for
    callers whose rows cannot be empty: it costs a device synchronization per call).
    With 3-d inputs every matmul is a single bmm, the bias added inside it (this runs at every decode step of
    every layer, where the number of operations, not their size, sets the cost).
    """
    dtype = compute_dtype(q, k, v)
    q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in (q, k, v))
    if bias is None:
        logits = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    elif q.dim() == 3 and bias.dim() == 3:
        logits = torch.baddbmm(bias.to(dtype), q, k.transpose(-1, -2), alpha=scale)
    else:
        logits = torch.add(bias.to(dtype), torch.matmul(q, k.transpose(-1, -2)), alpha=scale)
    if check_empty and not bool(torch.isfinite(logits.amax(dim=-1)).all()):
        raise EmptyRetainedSetError("an attention row has no retained slot (all logits are -inf or NaN)")
    weights = torch.softmax(logits, dim=-1)
    return _matmul(weights, v), weights


def effective_terms(terms: torch.Tensor) -> torch.Tensor:
    """Kish's effective number (Σc)² / Σc² of the terms behind V̂, from (..., 2) sums (Σc, Σc²).

    1 when one sampled slot carries all of the variance's weight, t when t slots carry equal weight; 0 when no
    sampled slot has weight (V̂ = 0). Returns (...,) in terms' dtype.
    """
    total, squares = terms[..., 0], terms[..., 1]
    return torch.where(squares > 0, total.square() / squares.clamp_min(torch.finfo(terms.dtype).tiny),
                       torch.zeros_like(total))


def hajek_with_variance(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    one_minus_pi: torch.Tensor,
    per_coordinate: bool = True,
    check_empty: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hájek output, its linearized variance and the variance's term sums, in one call.

    q: (..., m, d); k: (..., n, d); v: (..., n, dv); bias: broadcastable to (..., m, n) (−log π plus any −inf
    mask, as in ``hajek_with_weights``); one_minus_pi: (..., t), 1 − π of the first t slots, the only ones that
    may be sampled (later slots must be certain or not retained; the cache sorts sampled slots first).
    Returns out (..., m, dv); var (..., m, dv) per coordinate, or (..., m, 1) the trace Σ_j V̂_j, clamped at 0;
    terms (..., m, 2), (Σc, Σc²) of the term weights c_i = (1 − π_i) a_i². All float32 (float64 for float64
    inputs). Terms below the smallest normal float are dropped, as the compiled kernel drops them, so both
    paths count the same terms.

    Everything per slot lives only inside this call: the certificate of a decode needs, per query row, the
    sums Σc, Σc(v − μ) and Σc(v − μ)² (per coordinate), as the compiled kernel keeps them. The trace is the
    sum of the coordinates' variances, each clamped at 0. Values are centred on μ, the mean of
    the rows' outputs, before squaring, so that Σc(v − ô)² = Σc(v − μ)² − 2(ô − μ)·Σc(v − μ) + ‖ô − μ‖²Σc
    keeps no cancellation from a large common offset of the values.
    """
    dtype = compute_dtype(q, k, v)
    if q.dim() >= 3 and k.shape[0] > 1 and k.dtype != dtype and k.numel() > CONVERT_BLOCK_ELEMENTS:
        # A bfloat16/float16 cache is read in float32 one block of its leading dimension (batch rows x KV heads)
        # at a time, so that no float32 copy of all keys and values of the layer exists at once.
        block = max(1, CONVERT_BLOCK_ELEMENTS // k[:1].numel(), -(-k.shape[0] // MAX_CONVERT_BLOCKS))
        take = lambda x, i: x if x is None or x.shape[0] == 1 else x[i: i + block]  # noqa: E731
        # each block is converted here, so the call it goes to does not split it again
        parts = [hajek_with_variance(take(q, i).to(dtype), take(k, i).to(dtype), take(v, i).to(dtype), take(bias, i),
                                     scale, take(one_minus_pi, i), per_coordinate, check_empty)
                 for i in range(0, k.shape[0], block)]
        return tuple(torch.cat(tensors, dim=0) for tensors in zip(*parts))
    q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in (q, k, v))
    rows, n = q.shape[-2], k.shape[-2]
    per_row = n * max(1, math.prod(q.shape[:-2]))
    if rows > 1 and rows * per_row > ROW_BLOCK_ELEMENTS:
        # Rows are independent: a multi-token pass (the question, in the streaming setting) runs in blocks of
        # rows so that its (rows, n) logits and weights never exceed ROW_BLOCK_ELEMENTS at once.
        block = max(1, ROW_BLOCK_ELEMENTS // per_row)
        parts = [hajek_with_variance(q[..., i: i + block, :], k, v,
                                     bias if bias is None or bias.shape[-2] == 1 else bias[..., i: i + block, :],
                                     scale, one_minus_pi, per_coordinate, check_empty)
                 for i in range(0, rows, block)]
        return tuple(torch.cat(tensors, dim=-2) for tensors in zip(*parts))
    out, weights = hajek_with_weights(q, k, v, bias, scale, check_empty)
    t, dv = one_minus_pi.shape[-1], v.shape[-1]
    c = weights[..., :t].square_().mul_(one_minus_pi.to(dtype).unsqueeze(-2))  # (..., m, t), in the weights
    torch.nn.functional.threshold_(c, _SMALLEST_KEPT[dtype], 0.0)
    s0 = c.sum(-1, keepdim=True)  # (..., m, 1)
    terms = torch.cat([s0, torch.linalg.vecdot(c, c).unsqueeze(-1)], dim=-1)  # (..., m, 2)
    center = out.mean(dim=-2, keepdim=True)  # (..., 1, dv)
    centered = v[..., :t, :] - center  # (..., t, dv)
    s1 = _matmul(c, centered)  # (..., m, dv)
    s2 = _matmul(c, centered.square_())
    del weights, c, centered
    oc = out - center
    shift = torch.addcmul(s1, oc, s0, value=-0.5)  # Σc(v − μ) − ½ Σc (ô − μ)
    var = torch.addcmul(s2, oc, shift, value=-2.0).clamp_min_(0.0)  # per coordinate, (..., m, dv)
    if not per_coordinate:
        var = var.sum(-1, keepdim=True)
    return out, var, terms


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
    log_pi = log_pi.to(compute_dtype(q, k, v))
    out, var, _ = hajek_with_variance(q, k, v, offset_bias(log_pi).unsqueeze(-2), scale, one_minus_pi(log_pi))
    return out, var


def certificate(trace_var: torch.Tensor, delta: float = DELTA) -> torch.Tensor:
    """The (1−δ) Chebyshev bound on the error norm: ε̂_δ = sqrt(tr V̂ / δ) (docs/METHOD.md §4).

    trace_var: any shape, ≥ 0 (tiny negative rounding is clamped to 0); returns the same shape and dtype.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta} must lie in (0, 1)")
    return torch.sqrt(trace_var.clamp_min(0.0) / delta)

"""LeverageScore (Chari & Van Durme, 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores", arXiv:2507.08143)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..seeding import generator_or_seeded_zero
from .base import LayerView, register_policy


@register_policy("leverage")
@dataclass
class LeverageScore:
    """Statistical leverage of each key among the prefix's keys before RoPE: with X the keys of one KV head
    centred over the sequence and projected by a Gaussian (head_dim, r) / √r sketch (``sketch_dimension`` r;
    null: no sketch), the diagonal of X (XᵀX + ``ridge``·I)⁻¹ Xᵀ, in [0, 1): how far a key lies outside the
    span the other keys fill. Geometric outliers score high; the queries are not read.

    The paper (and kvpress) z-score the leverages over the layer, which gives negative scores; the Poisson
    design needs non-negative ones, and a z-score is an increasing affine map shared by every head of the
    layer, so kvcert keeps the leverage itself: the same order within and across heads."""

    sketch_dimension: int | None = 48
    ridge: float = 1e-2  # keeps XᵀX invertible when the keys span fewer than r directions
    needs_accumulated_attention = False
    needs_pre_rope_keys = True

    def __post_init__(self):
        r = self.sketch_dimension
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
            raise ValueError(f"sketch_dimension={r!r} must be a positive integer or null")
        if not isinstance(self.ridge, (int, float)) or not 0 < self.ridge < float("inf"):
            raise ValueError(f"ridge={self.ridge!r} must be a finite number > 0")

    def score(self, view: LayerView, generator: torch.Generator | None = None) -> torch.Tensor:
        """(batch, kv_heads, n) float32; with ``sketch_dimension`` one (head_dim, r) sketch per (batch, KV head)
        is drawn from ``generator`` (on the CPU; None: a generator seeded 0, so that the scores are a function of
        the view): a generator seeded s draws what ``torch.manual_seed(s)`` followed by
        ``torch.randn(batch, kv_heads, head_dim, r)`` would."""
        if view.pre_rope_keys is None:
            raise ValueError("policy leverage needs the keys before RoPE, which were not collected "
                             "(prefill(..., pre_rope_keys=True))")
        generator = generator_or_seeded_zero(generator)
        return leverage_scores(view.pre_rope_keys, self.sketch_dimension, self.ridge, generator).float()


def leverage_scores(keys: torch.Tensor, sketch_dimension: int | None, ridge: float,
                    generator: torch.Generator) -> torch.Tensor:
    """keys (b, h, n, d) -> (b, h, n) float64 ridge leverages of the sequence-centred, sketched keys; the
    sketch is drawn from ``generator`` (required: the global one would make the scores depend on what ran before)."""
    b, h, n, d = keys.shape
    x = keys.double() - keys.double().mean(dim=-2, keepdim=True)
    if sketch_dimension is not None:
        r = sketch_dimension
        sketch = torch.randn(b, h, d, r, generator=generator) / math.sqrt(r)
        x = x @ sketch.to(device=keys.device, dtype=torch.float64)  # (b, h, n, r)
    gram = x.transpose(-1, -2) @ x  # (b, h, r, r)
    gram = gram + ridge * torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    solved = torch.cholesky_solve(x.transpose(-1, -2), torch.linalg.cholesky(gram))  # (b, h, r, n)
    return (x * solved.transpose(-1, -2)).sum(-1).clamp_min(0)

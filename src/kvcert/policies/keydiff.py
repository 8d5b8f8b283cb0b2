"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv:2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy


@register_policy("keydiff")
@dataclass
class KeyDiff:
    """Keys unlike their head's average key direction matter: score = 1 − cos(k, mean of the unit keys)."""

    needs_accumulated_attention = False

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        keys = view.keys.float()  # (batch, kv_heads, n, head_dim)
        unit = keys / keys.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        anchor = unit.mean(dim=-2, keepdim=True)  # (batch, kv_heads, 1, head_dim)
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        # 1 - cos lies in [0, 2]: the paper ranks by -cos; the shift keeps the Poisson design's scores non-negative
        return 1.0 - (unit * anchor).sum(-1)  # (batch, kv_heads, n)

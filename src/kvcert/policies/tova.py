"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy

HEADS = ("kv_group", "all")


@register_policy("tova")
@dataclass
class TOVA:
    """Attention of the last prompt token alone, averaged over the heads that share a KV head (``heads="kv_group"``,
    a per-head variant) or over every head of the layer, one score for all KV heads (``heads="all"``, as the
    paper's code and kvpress do)."""

    heads: str = "kv_group"
    needs_accumulated_attention = False

    def __post_init__(self):
        if self.heads not in HEADS:
            raise ValueError(f"heads={self.heads!r} is unknown; known: {list(HEADS)}")

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        last = view.window_attention()[:, :, -1, :]  # (batch, q_heads, n)
        if self.heads == "all":
            return last.mean(dim=1, keepdim=True).repeat(1, view.keys.shape[1], 1)
        return view.group_mean(last)

"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import LayerView, register_policy


@register_policy("snapkv")
@dataclass
class SnapKV:
    """Attention of an observation window (the last prompt tokens) over the prefix, pooled over neighbours."""

    kernel_size: int = 5
    pooling: str = "avg"
    needs_accumulated_attention = False

    def __post_init__(self):
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size!r} must be a positive odd integer (a centred window)")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling={self.pooling!r} is unknown; known: ['avg', 'max']")

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        attention = view.window_attention().mean(dim=2)  # (b, q_heads, n)
        pool = {"avg": F.avg_pool1d, "max": F.max_pool1d}[self.pooling]
        pooled = pool(attention, kernel_size=self.kernel_size, stride=1, padding=self.kernel_size // 2)
        return view.group_mean(pooled[..., : view.n])

"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy


@register_policy("knorm")
@dataclass
class KNorm:
    """Keys with a small L2 norm draw attention: score = 1 / ‖k‖."""

    needs_accumulated_attention = False

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        return 1.0 / view.keys.float().norm(dim=-1).clamp_min(1e-6)

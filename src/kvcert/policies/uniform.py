"""Uniform sampling: no importance information (the paper's uniform-sampling baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy


@register_policy("uniform")
@dataclass
class Uniform:
    """Equal scores: top-k keeps a seeded uniformly random subset, Poisson samples the tail with flat π."""

    needs_accumulated_attention = False
    # With equal scores a "top slice" would be arbitrary; the whole non-sink, non-recent part is sampled.
    certain_top_slice = False

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        b, h, n, _ = view.keys.shape
        return torch.ones((b, h, n), device=view.keys.device)

"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy


@register_policy("h2o")
@dataclass
class H2O:
    """Attention each token received, accumulated over every prefill query (the heavy hitters)."""

    needs_accumulated_attention = True

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        if view.accumulated_attention is None:
            raise ValueError("policy h2o needs the prefill's accumulated attention, which was not collected")
        return view.group_mean(view.accumulated_attention.float())

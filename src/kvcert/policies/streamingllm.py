"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy


@register_policy("streamingllm")
@dataclass
class StreamingLLM:
    """Recency: with the design's attention sinks, the top-k keeps the sinks and the latest tokens."""

    needs_accumulated_attention = False

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        b, h, n, _ = view.keys.shape
        recency = torch.arange(1, n + 1, device=view.keys.device, dtype=torch.float32)
        return recency.expand(b, h, n).clone()

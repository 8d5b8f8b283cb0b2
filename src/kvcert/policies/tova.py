"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy


@register_policy("tova")
@dataclass
class TOVA:
    """Attention of the last prompt token alone, averaged over the heads that share a KV head."""

    needs_accumulated_attention = False

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        return view.group_mean(view.window_attention()[:, :, -1, :])

"""ObservedAttention (kvpress's ObservedAttentionPress, after Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy


@register_policy("observed_attention")
@dataclass
class ObservedAttention:
    """The attention each token received over the prefill, averaged over the queries at or after it (key j of
    n: n − j queries) rather than summed as ``h2o`` does, so that early tokens are not favoured for having been
    seen by more queries. In a sliding-window layer the count is still n − j, as in kvpress: the queries that
    could not see the key add zero."""

    needs_accumulated_attention = True

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        if view.accumulated_attention is None:
            raise ValueError("policy observed_attention needs the prefill's accumulated attention, which was not "
                             "collected (prefill(..., accumulate=True))")
        n = view.n
        queries_seeing = torch.arange(n, 0, -1, device=view.keys.device, dtype=torch.float32)  # (n,): n − j
        return view.group_mean(view.accumulated_attention.float() / queries_seeing)

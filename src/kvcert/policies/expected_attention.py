"""ExpectedAttention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating Attention
from Future Queries Distribution")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..query_statistics import check_statistics_options
from .base import LayerView, register_policy


@register_policy("expected_attention")
@dataclass
class ExpectedAttention:
    """The attention future queries are expected to pay each key, query-agnostic: a future query is modelled as
    Gaussian with the mean μ and covariance Σ of the prefix's queries before RoPE (leaving out the first
    ``n_sink``), rotated by R̄, the RoPE averaged over the next ``n_future_positions`` positions. Then
    E[exp(s·qᵀk)] = exp(s·μ̄ᵀk + s²/2·kᵀΣ̄k) (μ̄ = R̄μ, Σ̄ = R̄ΣR̄ᵀ, s the layer's scale), normalised over the
    non-sink keys (softmax), averaged over the query heads of each KV head, and, with ``use_vnorm``, times
    (· + ``epsilon``)·‖v‖₂. The ``n_sink`` first keys get the head's highest score (the design keeps its own
    sinks with certainty)."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    needs_accumulated_attention = False
    needs_query_statistics = True

    def __post_init__(self):
        check_statistics_options(self.n_future_positions, self.n_sink)
        if not isinstance(self.epsilon, (int, float)) or not 0 <= self.epsilon < float("inf"):
            raise ValueError(f"epsilon={self.epsilon!r} must be a finite number ≥ 0")

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        stats = view.query_statistics
        if stats is None:
            raise ValueError("policy expected_attention needs the prefill's query statistics, which were not "
                             "collected (prefill(..., query_statistics=True))")
        if view.n <= self.n_sink:
            raise ValueError(f"the prefix ({view.n} tokens) must be longer than n_sink={self.n_sink}")
        d = view.keys.shape[-1]
        mean, covariance = stats.moments(self.n_sink)  # (b, q_heads, d), (b, q_heads, d, d) float64
        rotation = stats.mean_rotation(self.n_future_positions, d)  # (d, d)
        mean = mean @ rotation.T
        keys = view.keys[..., self.n_sink:, :].double().repeat_interleave(view.group_size, dim=1)  # (b, hq, n', d)
        logits = view.scale * torch.einsum("bhnd,bhd->bhn", keys, mean)
        if self.use_covariance:
            covariance = rotation @ covariance @ rotation.T
            logits = logits + view.scale ** 2 / 2 * torch.einsum("bhnd,bhde,bhne->bhn", keys, covariance, keys)
        scores = view.group_mean(torch.softmax(logits, dim=-1))  # (b, kv_heads, n')
        if self.use_vnorm:
            scores = (scores + self.epsilon) * view.values[..., self.n_sink:, :].double().norm(dim=-1)
        sinks = scores.amax(dim=-1, keepdim=True).expand(*scores.shape[:-1], self.n_sink)
        return torch.cat([sinks, scores], dim=-1).float()

"""CriticalKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation
Perspective")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import POLICIES, LayerView, get_policy, register_policy


@register_policy("criticalkv")
@dataclass
class CriticalKV:
    """A base policy's score re-weighted by how much each value can move the layer's output: (score +
    ``epsilon``)·‖W_o^h v‖₁, the L1 norm of the value projected by its query head's slice of the output
    projection, averaged over the query heads of each KV head. ``base`` is a registered policy, built with its
    default options. The paper's (and kvpress's) first stage, which keeps a share of the budget by the base
    score alone, depends on the budget, which a score does not know; kvcert's designs choose the kept set."""

    base: str = "snapkv"
    epsilon: float = 1e-4

    def __post_init__(self):
        if self.base == "criticalkv" or self.base not in POLICIES:
            known = sorted(set(POLICIES) - {"criticalkv"})
            raise ValueError(f"base={self.base!r} is not a policy CriticalKV can re-weight; known: {known}")
        if not isinstance(self.epsilon, (int, float)) or not 0 <= self.epsilon < float("inf"):
            raise ValueError(f"epsilon={self.epsilon!r} must be a finite number ≥ 0")
        self._base = get_policy(self.base)

    @property
    def needs_accumulated_attention(self) -> bool:
        return self._base.needs_accumulated_attention

    @property
    def needs_query_statistics(self) -> bool:
        return self._base.needs_query_statistics

    @property
    def needs_pre_rope_keys(self) -> bool:
        return self._base.needs_pre_rope_keys

    @property
    def certain_top_slice(self) -> bool:
        return self._base.certain_top_slice

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        if view.output_projection is None:
            raise ValueError("policy criticalkv needs the layer's output projection (o_proj), which the prefill "
                             "did not find")
        return (self._base.score(view, generator) + self.epsilon) * view.group_mean(projected_value_norm(view))


def projected_value_norm(view: LayerView) -> torch.Tensor:
    """(batch, q_heads, n): ‖v W_o^h‖₁ per query head h, W_o^h (head_dim, hidden) the rows of Wᵀ_o that read
    head h's output, v the value of h's KV head. One head at a time: the (n, hidden) products stay small."""
    weight = view.output_projection  # (hidden, q_heads·head_dim)
    b, hk, n, d = view.values.shape
    hq = view.window_queries.shape[1]
    per_head = weight.float().t().reshape(hq, d, weight.shape[0])  # (q_heads, head_dim, hidden)
    values = view.values.float()
    norms = [torch.matmul(values[:, h // view.group_size], per_head[h]).abs().sum(-1) for h in range(hq)]
    return torch.stack(norms, dim=1)

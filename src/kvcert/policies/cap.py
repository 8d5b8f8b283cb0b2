"""Cap (CAPKV, arXiv:2604.25975: capacity-aware KV retention with a historical-query anchor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..query_statistics import check_statistics_options
from .base import LayerView, register_policy


@register_policy("cap")
@dataclass
class Cap:
    """A key's share of the capacity its value adds to the output, weighted by its alignment with the anchor.

    The anchor a of a query head is the mean of the prefix's queries before RoPE (leaving out the first
    ``n_sink``), rotated by R̄, the RoPE averaged over the next ``n_future_positions`` positions (ExpectedAttention's
    μ̄, from the same statistics). Each non-sink key i gets w_i = exp(τ·(cos(a, k_i) − max_j cos(a, k_j))) (τ
    ``tau``; the shift is part of the score: A below is not invariant to scaling w), and the score
    w_i · v_iᵀ A⁻¹ v_i with A = I + Σ_j (w_j + ``epsilon``) v_j v_jᵀ: the leverage of v_i in the weighted values,
    averaged over the query heads of each KV head. The ``n_sink`` first keys get the head's highest score (the
    design keeps its own sinks with certainty)."""

    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int = 4
    epsilon: float = 1e-6
    needs_accumulated_attention = False
    needs_query_statistics = True

    def __post_init__(self):
        check_statistics_options(self.n_future_positions, self.n_sink)
        for option in ("tau", "epsilon"):
            value = getattr(self, option)
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{option}={value!r} must be a finite number ≥ 0")

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        stats = view.query_statistics
        if stats is None:
            raise ValueError("policy cap needs the prefill's query statistics, which were not collected "
                             "(prefill(..., query_statistics=True))")
        if view.n <= self.n_sink:
            raise ValueError(f"the prefix ({view.n} tokens) must be longer than n_sink={self.n_sink}")
        d = view.keys.shape[-1]
        mean, _ = stats.moments(self.n_sink)  # (b, q_heads, d) float64
        anchor = mean @ stats.mean_rotation(self.n_future_positions, d).T
        group = view.group_size
        keys = view.keys[..., self.n_sink:, :].double().repeat_interleave(group, dim=1)  # (b, hq, n', d)
        values = view.values[..., self.n_sink:, :].double().repeat_interleave(group, dim=1)  # (b, hq, n', dv)
        cosine = torch.einsum("bhd,bhnd->bhn", torch.nn.functional.normalize(anchor, dim=-1),
                              torch.nn.functional.normalize(keys, dim=-1)).clamp(-1.0, 1.0)
        logits = self.tau * cosine
        weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))  # (b, hq, n')
        capacity = torch.eye(values.shape[-1], dtype=torch.float64, device=values.device) + torch.einsum(
            "bhn,bhnd,bhne->bhde", weights + self.epsilon, values, values)
        solved = torch.linalg.solve(capacity, values.transpose(-1, -2))  # (b, hq, dv, n')
        scores = view.group_mean(weights * (values.transpose(-1, -2) * solved).sum(-2))  # (b, kv_heads, n')
        sinks = scores.amax(dim=-1, keepdim=True).expand(*scores.shape[:-1], self.n_sink)
        return torch.cat([sinks, scores], dim=-1).float()

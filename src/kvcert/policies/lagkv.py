"""LagKV (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important",
arXiv:2504.04704)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerView, register_policy


@register_policy("lagkv")
@dataclass
class LagKV:
    """Each lag_size-token partition after the sinks is scored against the next one: the spread over channels of
    its keys and values min-max scaled by the next partition's range, as ranks within the partition (or, with
    ``cross_scoring``, as the softmax shares themselves); sinks and the unscored last partitions score 1."""

    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False
    needs_accumulated_attention = False

    def __post_init__(self):
        if not isinstance(self.n_sink, int) or isinstance(self.n_sink, bool) or self.n_sink < 0:
            raise ValueError(f"n_sink={self.n_sink!r} must be a non-negative integer")
        if not isinstance(self.lag_size, int) or isinstance(self.lag_size, bool) or self.lag_size < 2:
            raise ValueError(f"lag_size={self.lag_size!r} must be an integer >= 2 (a partition of tokens)")
        if not isinstance(self.cross_scoring, bool):
            raise ValueError(f"cross_scoring={self.cross_scoring!r} must be true or false")

    def score(self, view: LayerView, generator=None) -> torch.Tensor:
        keys, values = view.keys.float(), view.values.float()  # (batch, kv_heads, n, head_dim)
        b, h, n, _ = keys.shape
        scores = torch.ones((b, h, n), device=keys.device)
        lag = self.lag_size
        if n < self.n_sink + 2 * lag:
            # No partition has a successor to compare with: LagKV compresses nothing, so rank by recency after
            # the sinks (0 for the first non-sink token up to (n - n_sink - 1) / (n - n_sink) for the last).
            if n > self.n_sink:
                tail = n - self.n_sink
                scores[..., self.n_sink:] = torch.arange(tail, device=keys.device) / tail
            return scores
        partitions = (n - self.n_sink) // lag
        end = self.n_sink + (partitions - 1) * lag  # the last full partition has no successor: it scores 1
        share = (self._spread_share(keys, partitions) + self._spread_share(values, partitions)) / 2
        if not self.cross_scoring:
            share = share.argsort(dim=-1).argsort(dim=-1).float() / lag  # rank within the partition, in [0, 1)
        scores[..., self.n_sink: end] = share.reshape(b, h, -1)
        return scores

    def _spread_share(self, states: torch.Tensor, partitions: int) -> torch.Tensor:
        """(batch, kv_heads, n, d) -> (batch, kv_heads, partitions - 1, lag_size): per token of each partition but the
        last full one, the softmax over the partition of the std over channels of the token's states min-max scaled
        by the next partition's per-channel range. A channel without range there (constant, e.g. a key channel
        that a norm's zero weight silences) carries no lag-relative information and is left out of the std."""
        b, h, _, d = states.shape
        blocks = states[..., self.n_sink: self.n_sink + partitions * self.lag_size, :]
        blocks = blocks.reshape(b, h, partitions, self.lag_size, d)
        scored, reference = blocks[:, :, :-1], blocks[:, :, 1:]
        low = reference.amin(dim=-2, keepdim=True)
        span = reference.amax(dim=-2, keepdim=True) - low  # (b, h, partitions - 1, 1, d)
        live = span > 0
        scaled = torch.where(live, (scored - low) / torch.where(live, span, 1.0), 0.0)
        if bool(live.all()):
            spread = scaled.std(dim=-1)
        else:  # the std (Bessel-corrected) over the live channels only; 0 with fewer than two
            count = live.sum(-1).float()
            mean = scaled.sum(-1) / count.clamp_min(1)
            squares = torch.where(live, (scaled - mean.unsqueeze(-1)).square(), 0.0).sum(-1)
            spread = torch.where(count > 1, (squares / (count - 1).clamp_min(1)).sqrt(), 0.0)
        return spread.softmax(dim=-1)

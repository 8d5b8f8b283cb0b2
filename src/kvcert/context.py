"""What kvcert attention needs besides the cache, owned by the prefill or the decoding that needs it.

The cache (``kvcert.cache``) only stores slots. A forward pass on it is given an ``AttentionContext``: the
cache, and what this pass must do beside attending. The prefill gives its ``Observation``s (what the scoring
policies read), a certified decoding its ``CertificateRecorder``, an oracle decoding the prefill's
uncompressed cache to compare against. ``kvcert.prefill`` and ``Decoding`` pass it to the model as the
``kvcert_context`` keyword, which transformers forwards to attention functions; ``kvcert.attach(model,
cache_or_context)`` binds one for calls that drop unknown keywords, such as ``model.generate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import CompressedCache
from .certificates import CertificateRecorder
from .estimator import one_minus_pi
from .peer_sampling import DecodeSampler
from .query_statistics import QueryStatistics


@dataclass
class Observation:
    """What the prefill records in one layer for the scoring policies.

    window_queries: (batch, q_heads, w, head_dim); accumulated_attention: (batch, q_heads, n) or None;
    query_statistics: the prefix queries' statistics before RoPE (``kvcert.query_statistics``), or None when
    not collected (the prefill gives it its rotary tables when asked to collect); output_projection:
    (hidden, q_heads·head_dim), the layer's output projection weight as the model holds it (a reference, no
    copy), or None where the attention module has no ``o_proj``; pre_rope_keys: (batch, kv_heads, n, head_dim)
    float32 keys before RoPE, set after the prefill when asked for, else None; scale and sliding_window: the layer's, as the
    model's attention module passed them.
    """

    window: int
    accumulate: bool
    window_queries: torch.Tensor | None = None
    accumulated_attention: torch.Tensor | None = None
    query_statistics: QueryStatistics | None = None
    output_projection: torch.Tensor | None = field(default=None, repr=False)
    pre_rope_keys: torch.Tensor | None = field(default=None, repr=False)
    scale: float | None = None
    sliding_window: int | None = None


@dataclass
class AttentionContext:
    """One forward pass's instructions: attend over ``cache``; record ``observations`` (prefill: one per
    layer); hand certified calls to ``recorder``; compare with ``oracle`` (the prefill's cache, whose layers
    hold the full prefix, batch 1)."""

    cache: CompressedCache
    observations: list[Observation] | None = None
    recorder: CertificateRecorder | None = None
    oracle: CompressedCache | None = field(default=None, repr=False)
    samplers: dict[int, list[DecodeSampler]] = field(default_factory=dict, repr=False)
    # kvcert.decode_compression.DecodeCompressor: keeps the cache under a decode-time bound (None: no bound)
    compressor: object | None = field(default=None, repr=False)
    _tails: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def tail_one_minus_pi(self, layer_idx: int) -> torch.Tensor:
        """1 − π of layer ``layer_idx``'s first ``n_sampled_slots`` slots, the only ones that may have π < 1,
        (batch, kv_heads, t) contiguous: computed once per retained set (a decode-time compression drops the
        layer's)."""
        if layer_idx not in self._tails:
            layer = self.cache.layers[layer_idx]
            self._tails[layer_idx] = one_minus_pi(layer.log_pi[..., : layer.n_sampled_slots]).contiguous()
        return self._tails[layer_idx]

    @classmethod
    def for_prefill(cls, num_layers: int, observation_window: int, accumulate: bool) -> AttentionContext:
        """An empty cache whose layers are observed (the window's queries, and accumulated attention)."""
        return cls(CompressedCache.empty(num_layers),
                   [Observation(window=observation_window, accumulate=accumulate) for _ in range(num_layers)])


__all__ = ["AttentionContext", "Observation"]

"""A ``transformers.Cache`` that holds a physically compressed KV cache with per-slot log π.

Each layer stores, per KV head, only its retained slots (rows padded to the longest with log π = −inf)
together with the slots' original positions, so RoPE'd keys keep their positions and new tokens get
positions that continue the original sequence (``get_seq_length`` reports the logical length). The
kvcert attention function (``kvcert.attention``) reads ``log_pi`` and ``positions`` to apply the Hájek
offset and the causal / sliding-window mask. In oracle mode the uncompressed keys and values are kept
beside the compressed ones so that every step can be compared against full attention.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .designs import Selection

_ACTIVE = threading.local()


def active_cache(layer_idx: int, key: torch.Tensor) -> CompressedCache | None:
    """The CompressedCache whose layer ``layer_idx`` has just returned exactly ``key`` from ``update``, if any.

    ``model.generate`` refuses unknown keywords such as ``kvcert_cache``, so the attention function falls back
    to the cache most recently updated on this thread; the identity check makes a stale entry harmless.
    """
    ref = getattr(_ACTIVE, "cache", None)
    cache = ref() if ref is not None else None
    if cache is None or layer_idx >= len(cache.layers) or cache.layers[layer_idx].keys is not key:
        return None
    return cache


@dataclass
class Observation:
    """What the prefill records in one layer for the scoring policies.

    window_queries: (batch, q_heads, w, head_dim); accumulated_attention: (batch, q_heads, n) or None.
    """

    window: int
    accumulate: bool
    window_queries: torch.Tensor | None = None
    accumulated_attention: torch.Tensor | None = None


@dataclass
class StepRecord:
    """Per-step statistics of one attention call over a compressed layer.

    Tensors are (batch, kv_heads, m) for the m query positions of the call, float32; query heads of a KV
    head are stacked into one output vector (so traces add and norms are of the concatenation).
    """

    layer: int
    first_step: int
    trace_var: torch.Tensor
    out_norm: torch.Tensor
    true_err: torch.Tensor | None = None
    wald_coverage: torch.Tensor | None = None


class CompressedLayer(CacheLayerMixin):
    """One layer: keys/values (batch, kv_heads, slots, head_dim), log_pi and positions (batch, kv_heads, slots)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False  # slots are never dropped by position: the window is applied as a mask

    def __init__(self, sliding_window: int | None = None, observation: Observation | None = None):
        super().__init__()
        self.sliding_window = sliding_window  # set by the attention function from the model's layer
        self.scale: float | None = None  # likewise
        self.observation = observation
        self.log_pi: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.length = 0
        self.full_keys: torch.Tensor | None = None
        self.full_values: torch.Tensor | None = None
        self.has_tail = False
        self.compressed = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h = key_states.shape[:2]
        self.device = key_states.device
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.log_pi = torch.zeros((b, h, 0), dtype=torch.float32, device=self.device)
        self.positions = torch.zeros((b, h, 0), dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append m new tokens (batch, kv_heads, m, head_dim) as certain slots; return all slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, m, _ = key_states.shape
        new_positions = torch.arange(self.length, self.length + m, device=self.device).expand(b, h, m)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.log_pi = torch.cat([self.log_pi, self.log_pi.new_zeros((b, h, m))], dim=-1)
        self.positions = torch.cat([self.positions, new_positions], dim=-1)
        if self.full_keys is not None:
            self.full_keys = torch.cat([self.full_keys, key_states], dim=-2)
            self.full_values = torch.cat([self.full_values, value_states], dim=-2)
        self.length += m
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def nbytes(self) -> int:
        """Bytes held for attention (keys, values, log π, positions); the oracle copy is not counted."""
        tensors = (self.keys, self.values, self.log_pi, self.positions)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def derive(self, selection: Selection | None, oracle: bool) -> CompressedLayer:
        """A new layer holding this layer's slots, or only ``selection``'s; this layer is left untouched.

        selection.index/log_pi: (batch, kv_heads, k). None keeps every slot (the full cache).
        """
        layer = CompressedLayer(self.sliding_window)
        layer.scale = self.scale
        layer.device, layer.length, layer.is_initialized = self.device, self.length, True
        if selection is None:
            layer.keys, layer.values = self.keys, self.values
            layer.log_pi, layer.positions = self.log_pi, self.positions
        else:
            index = selection.index.to(self.device)
            gather = index.unsqueeze(-1).expand(*index.shape, self.keys.shape[-1])
            layer.keys = self.keys.gather(-2, gather)
            layer.values = self.values.gather(-2, index.unsqueeze(-1).expand(*index.shape, self.values.shape[-1]))
            layer.log_pi = selection.log_pi.to(self.device)
            layer.positions = self.positions.gather(-1, index)
            layer.compressed = True
            layer.has_tail = bool(((layer.log_pi < 0) & torch.isfinite(layer.log_pi)).any())
            if oracle:
                layer.full_keys, layer.full_values = self.keys, self.values
        return layer


class CompressedCache(Cache):
    """A cache of ``CompressedLayer``s plus what the attention function should compute and record.

    certify: compute tr V̂ per step on compressed layers; oracle: keep the full cache beside and compute
    the true error; records: the ``StepRecord``s appended by the attention function.
    """

    def __init__(self, layers: list[CompressedLayer], *, certify: bool = False, oracle: bool = False):
        super().__init__(layers=layers)
        self.certify = certify
        self.oracle = oracle
        self.records: list[StepRecord] = []
        self.compressed_length = max((layer.length for layer in layers), default=0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append to layer ``layer_idx`` (see ``CompressedLayer.update``) and mark this cache as the active one."""
        _ACTIVE.cache = weakref.ref(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @classmethod
    def for_prefill(cls, num_layers: int, window: int, accumulate: bool) -> CompressedCache:
        """An empty cache whose layers record the observation window (and accumulated attention)."""
        layers = [CompressedLayer(None, Observation(window=window, accumulate=accumulate)) for _ in range(num_layers)]
        return cls(layers)

    def derive(
        self, selections: list[Selection | None] | None, *, certify: bool = False, oracle: bool = False
    ) -> CompressedCache:
        """A new cache for one configuration; ``selections`` per layer (None: the full cache)."""
        selections = selections if selections is not None else [None] * len(self.layers)
        layers = [layer.derive(sel, oracle=oracle) for layer, sel in zip(self.layers, selections)]
        return CompressedCache(layers, certify=certify, oracle=oracle)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


__all__ = ["CompressedCache", "CompressedLayer", "Observation", "StepRecord", "active_cache"]

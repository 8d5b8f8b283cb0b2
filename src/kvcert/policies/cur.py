"""CurDKV (Sengupta et al., 2025, "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition",
arXiv:2509.15038)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..seeding import generator_or_seeded_zero
from .base import LayerView, register_policy

# how the key and value leverage shares, each (batch, kv_heads, n), combine into one score
COMBINE = {"key": lambda k, v: k, "value": lambda k, v: v, "kv_avg": lambda k, v: (k + v) / 2,
           "kv_product": lambda k, v: k * v}


@register_policy("cur")
@dataclass
class CUR:
    """Approximate leverage scores of keys and values: squared norms as shares of their local block
    (``local_window_size`` tokens; None: of the whole prefix), combined per ``leverage``, normalised to sum 1."""

    leverage: str = "kv_product"
    local_window_size: int | None = 16
    sketch_dimension: int | None = None  # r: keys and values first projected by one Gaussian (d, r) / sqrt(r)
    needs_accumulated_attention = False

    def __post_init__(self):
        if self.leverage not in COMBINE:
            raise ValueError(f"leverage={self.leverage!r} is unknown; known: {list(COMBINE)}")
        for option in ("local_window_size", "sketch_dimension"):
            value = getattr(self, option)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{option}={value!r} must be a positive integer or null")

    def score(self, view: LayerView, generator: torch.Generator | None = None) -> torch.Tensor:
        """(batch, kv_heads, n); with ``sketch_dimension`` the (head_dim, r) sketch is drawn from ``generator`` (on
        the CPU, then moved; None: a generator seeded 0, so that the scores are a function of the view), one per
        call, shared by every head: a generator seeded s draws what ``torch.manual_seed(s)`` followed by
        ``torch.randn(head_dim, r)`` would."""
        keys, values = view.keys.float(), view.values.float()  # (batch, kv_heads, n, head_dim)
        if self.sketch_dimension is not None:
            r = self.sketch_dimension
            generator = generator_or_seeded_zero(generator)
            sketch = torch.randn(keys.shape[-1], r, generator=generator) / math.sqrt(r)
            sketch = sketch.to(keys.device)
            keys, values = keys @ sketch, values @ sketch
        key_share, value_share = self._local_share(keys.square().sum(-1)), self._local_share(values.square().sum(-1))
        scores = COMBINE[self.leverage](key_share, value_share)
        return scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)

    def _local_share(self, mass: torch.Tensor) -> torch.Tensor:
        """(batch, kv_heads, n) -> the same, each entry divided by the total of its block of local_window_size
        consecutive tokens (the last block may be shorter); unchanged without a local window."""
        if self.local_window_size is None:
            return mass
        w, n = self.local_window_size, mass.shape[-1]
        blocks = F.pad(mass, (0, -n % w)).reshape(*mass.shape[:-1], -1, w)
        shares = blocks / blocks.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return shares.reshape(*mass.shape[:-1], -1)[..., :n]

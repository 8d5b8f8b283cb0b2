"""A ``transformers.Cache`` that holds a physically compressed KV cache with per-slot log π.

Each layer stores, per KV head, only its retained slots (rows padded to the longest with log π = −inf)
together with the slots' original positions, so RoPE'd keys keep their positions and new tokens get
positions that continue the original sequence (``get_seq_length`` reports the logical length). The
kvcert attention function (``kvcert.attention``) reads ``log_pi`` and ``positions`` to apply the Hájek
offset and the causal / sliding-window mask. One cache can hold several configurations of the same prompt
as batch rows, decoded together. What a pass does beside attending (the prefill's observations, the
certificate recorder, the oracle's full prefix) is owned by the prefill or decoding that needs it
(``kvcert.context``), never by the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from .designs import Selection
from .estimator import offset_bias, sampled_slots

DECODE_CHUNK = 64  # slots for generated tokens a press's cache allocates at a time (never past max_new_tokens)


def decode_reserve(new_tokens: int | None) -> int:
    """The slots a press's compressed cache allocates at its prefill for generated tokens: DECODE_CHUNK, or fewer
    where ``generate`` asks for fewer new tokens (its last token is never fed back, so new_tokens − 1 suffice)."""
    return DECODE_CHUNK if new_tokens is None else max(0, min(DECODE_CHUNK, new_tokens - 1))


class CompressedLayer(CacheLayerMixin):
    """One layer: keys/values (batch, kv_heads, slots, head_dim); log_pi, offset and positions (batch, kv_heads, slots).

    The batch holds one configuration per row (rows padded to the longest with log π = −inf). Slots live in
    buffers with spare capacity, so appending a token writes in place instead of copying the cache.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False  # slots are never dropped by position: the window is applied as a mask

    def __init__(self):
        super().__init__()
        self.log_pi: torch.Tensor | None = None
        self.offset: torch.Tensor | None = None  # −log π (−inf where not retained): the attention bias
        self.positions: torch.Tensor | None = None
        self.length = 0
        self.filled = 0
        self._buffers: tuple[torch.Tensor, ...] | None = None  # keys, values, log_pi, offset, positions
        self.n_prefix_slots = 0  # slots [0, n_prefix_slots) came from the prefix; appended tokens follow
        self.n_sampled_slots = 0  # slots [0, n_sampled_slots) hold every π < 1 of every row (derive sorts them first)
        self.compressed = False
        # How full buffers grow (``grow_on_demand``): None doubles them; else by at least this many slots
        self.grow_chunk: int | None = None
        self.max_slots: int | None = None  # with grow_chunk: the most slots growth allocates (None: no limit)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h = key_states.shape[:2]
        self.device = key_states.device
        no_slots = torch.zeros((b, h, 0), dtype=torch.float32, device=self.device)
        self._allocate(
            key_states[..., :0, :], value_states[..., :0, :], no_slots, no_slots,
            torch.zeros((b, h, 0), dtype=torch.long, device=self.device),
            capacity=key_states.shape[-2],
        )
        self.is_initialized = True

    def _allocate(self, keys, values, log_pi, offset, positions, capacity: int) -> None:
        """Copy the given slots into fresh buffers with room for ``capacity`` slots."""
        filled = keys.shape[-2]
        capacity = max(capacity, filled)
        buffers = []
        for t in (keys, values, log_pi, offset, positions):
            shape = (*t.shape[:2], capacity, *t.shape[3:])
            buf = torch.empty(shape, dtype=t.dtype, device=t.device)
            buf[:, :, :filled] = t
            buffers.append(buf)
        self._buffers = tuple(buffers)
        self.filled = filled
        self._expose()

    def _expose(self) -> None:
        k, v, lp, off, pos = self._buffers
        self.keys, self.values = k[:, :, : self.filled], v[:, :, : self.filled]
        self.log_pi, self.offset = lp[:, :, : self.filled], off[:, :, : self.filled]
        self.positions = pos[:, :, : self.filled]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append m new tokens (batch, kv_heads, m, head_dim) as certain slots; return all slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m = key_states.shape[-2]
        if self.filled + m > self._buffers[0].shape[2]:
            self._allocate(self.keys, self.values, self.log_pi, self.offset, self.positions, self._grown(m))
        k, v, lp, off, pos = self._buffers
        end = self.filled + m
        k[:, :, self.filled : end] = key_states
        v[:, :, self.filled : end] = value_states
        lp[:, :, self.filled : end] = 0.0
        off[:, :, self.filled : end] = 0.0
        pos[:, :, self.filled : end] = torch.arange(self.length, self.length + m, device=self.device)
        self.filled = end
        self.length += m
        self._expose()
        return self.keys, self.values

    def grow_on_demand(self, new_tokens: int | None, chunk: int | None = None) -> None:
        """Grow full buffers by chunks instead of doubling them: by max(chunk, an eighth of the slots) at a time
        (amortised: a token is copied a bounded number of times on average; chunk None: DECODE_CHUNK), never past
        the prefix's slots plus ``new_tokens`` (the tokens a generation can still append; None: no limit)."""
        self.grow_chunk = DECODE_CHUNK if chunk is None else chunk
        self.max_slots = None if new_tokens is None else self.n_prefix_slots + new_tokens

    def _grown(self, m: int) -> int:
        """The capacity to reallocate to when ``m`` more slots do not fit."""
        need = self.filled + m
        if self.grow_chunk is None:
            return max(2 * self.filled, need)
        grown = self.filled + max(self.grow_chunk, need // 8, m)
        return max(need, grown if self.max_slots is None else min(grown, self.max_slots))

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def derive(self, selections: list[Selection | None], reserve: int = 0) -> CompressedLayer:
        """A new layer with one row per configuration; this (prefill, batch 1) layer is left untouched.

        selections: per row a Selection (index/log_pi (1, kv_heads, k_r)) or None for every slot (the full
        cache). Rows are padded to the longest; ``reserve`` slots of capacity are kept for appended tokens.
        """
        n = self.filled
        rows = []
        for sel in selections:
            if sel is None:
                index = torch.arange(n, device=self.device).expand(1, self.keys.shape[1], n)
                log_pi = torch.zeros(index.shape, dtype=torch.float32, device=self.device)
            else:
                index, log_pi = sel.index.to(self.device), sel.log_pi.to(self.device)
            rows.append((index, log_pi))
        k_max = max(index.shape[-1] for index, _ in rows)
        index = torch.cat([F.pad(i, (0, k_max - i.shape[-1])) for i, _ in rows])
        log_pi = torch.cat([F.pad(lp, (0, k_max - lp.shape[-1]), value=float("-inf")) for _, lp in rows])
        batch = len(rows)
        # Sampled (π < 1) slots first: the variance then reads a prefix of the slots instead of all of them.
        # Slot order is free (positions travel with the slots and masks are built from them).
        sampled = sampled_slots(log_pi)
        order = torch.argsort((~sampled).to(torch.uint8), dim=-1, stable=True)
        index, log_pi = index.gather(-1, order), log_pi.gather(-1, order)
        n_sampled = int(sampled.sum(-1).max()) if sampled.numel() else 0

        def gather(t: torch.Tensor) -> torch.Tensor:
            expanded = t.expand(batch, *t.shape[1:])
            if t.ndim == 4:
                return expanded.gather(2, index.unsqueeze(-1).expand(*index.shape, t.shape[-1]))
            return expanded.gather(2, index)

        layer = CompressedLayer()
        layer.device, layer.length, layer.is_initialized = self.device, self.length, True
        layer._allocate(gather(self.keys), gather(self.values), log_pi, offset_bias(log_pi), gather(self.positions),
                        k_max + reserve)
        layer.n_prefix_slots = k_max
        layer.n_sampled_slots = n_sampled
        layer.compressed = any(sel is not None for sel in selections)
        return layer


class CompressedCache(Cache):
    """A ``transformers.Cache`` of ``CompressedLayer``s: it stores slots, nothing else."""

    def __init__(self, layers: list[CompressedLayer]):
        super().__init__(layers=layers)

    @classmethod
    def empty(cls, num_layers: int) -> CompressedCache:
        """A cache with no slots yet (a prefill fills it)."""
        return cls([CompressedLayer() for _ in range(num_layers)])

    def derive(self, selections: list[Selection] | None, *, reserve: int = 0) -> CompressedCache:
        """A new cache for one configuration: per-layer ``selections``, or None for the full cache."""
        return self.derive_batch([selections], reserve=reserve)

    def derive_batch(self, configurations: list[list[Selection] | None], *, reserve: int = 0) -> CompressedCache:
        """A new cache with one batch row per configuration; this (prefill) cache is left untouched.

        configurations: per row, the per-layer Selections, or None for the full cache. ``reserve``: slots
        of spare capacity for the tokens that will be appended.
        """
        layers = [
            layer.derive([None if rows is None else rows[i] for rows in configurations], reserve=reserve)
            for i, layer in enumerate(self.layers)
        ]
        return CompressedCache(layers)


__all__ = ["DECODE_CHUNK", "CompressedCache", "CompressedLayer", "decode_reserve"]

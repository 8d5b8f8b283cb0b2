"""A ``transformers.Cache`` that holds a physically compressed KV cache with per-slot log π.

Each layer stores, per KV head, only its retained slots (rows padded to the longest with log π = −inf)
together with the slots' original positions, so RoPE'd keys keep their positions and new tokens get
positions that continue the original sequence (``get_seq_length`` reports the logical length). The
kvcert attention function (``kvcert.attention``) reads ``log_pi`` and ``positions`` to apply the Hájek
offset and the causal / sliding-window mask. In oracle mode the uncompressed keys and values are kept
beside the compressed ones so that every step can be compared against full attention. One cache can
hold several configurations of the same prompt as batch rows, decoded together.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from .designs import Selection
from .estimator import TailMoments, linearized_variance, offset_bias, sampled_slots, tail_moments, tail_weight
from .kernels import hajek_step_op

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


WALD_Z = 1.959963984540054  # two-sided nominal 95% normal quantile


@dataclass
class StepRecord:
    """Statistics of one forward pass over the compressed layers ``layers``, for query steps first_step, ….

    Tensors are (len(layers), batch, kv_heads, m) for the m query positions of the pass, float32; the
    query heads of a KV head are stacked into one output vector (so traces add and norms are of the
    concatenation). true_err and wald_coverage are set in oracle mode.
    """

    layers: tuple[int, ...]
    first_step: int
    trace_var: torch.Tensor
    out_norm: torch.Tensor
    true_err: torch.Tensor | None = None
    wald_coverage: torch.Tensor | None = None


@dataclass
class _PendingStep:
    """One certified attention call, kept raw until its forward pass is complete.

    out/full_out: (batch·kv_heads, group·m, dv); shape = (batch, kv_heads, group, m, dv). Either
    tail_weights, (batch·kv_heads, group·m, t), the softmax weights of the layer's t sampled slots, or var,
    the per-coordinate variance the compiled kernel already computed. With var, out and var may also come
    unflattened, (batch, kv_heads, group·m, dv), as the kernel returns them.
    """

    layer: int
    first_step: int
    shape: tuple[int, ...]
    out: torch.Tensor
    tail_weights: torch.Tensor | None
    full_out: torch.Tensor | None
    var: torch.Tensor | None = None


def _stack_rows(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Stack per-layer (batch·kv_heads, group·m, ·) or (batch, kv_heads, group·m, ·) tensors into
    (L, batch·kv_heads, group·m, ·); shape = (L, batch, kv_heads, group, m, dv)."""
    rows, width = shape[1] * shape[2], shape[3] * shape[4]
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors).reshape(len(tensors), rows, width, -1)
    return torch.stack([t.reshape(rows, width, -1) for t in tensors])


class CompressedLayer(CacheLayerMixin):
    """One layer: keys/values (batch, kv_heads, slots, head_dim); log_pi, offset and positions (batch, kv_heads, slots).

    The batch holds one configuration per row (rows padded to the longest with log π = −inf). Slots live in
    buffers with spare capacity, so appending a token writes in place instead of copying the cache.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False  # slots are never dropped by position: the window is applied as a mask

    def __init__(self, sliding_window: int | None = None, observation: Observation | None = None):
        super().__init__()
        self.sliding_window = sliding_window  # set by the attention function from the model's layer
        self.scale: float | None = None  # likewise
        self.observation = observation
        self.log_pi: torch.Tensor | None = None
        self.offset: torch.Tensor | None = None  # −log π (−inf where not retained): the attention bias
        self.positions: torch.Tensor | None = None
        self.length = 0
        self.filled = 0
        self._buffers: tuple[torch.Tensor, ...] | None = None  # keys, values, log_pi, offset, positions
        # Oracle: the uncompressed prefix (1, kv_heads, n, head_dim); appended tokens are the slots after
        # n_prefix_slots, shared by the compressed and the full view.
        self.prefix_keys: torch.Tensor | None = None
        self.prefix_values: torch.Tensor | None = None
        self.n_prefix_slots = 0
        self.n_sampled_slots = 0  # slots [0, n_sampled_slots) hold every π < 1 of every row (derive sorts them first)
        self.one_minus_pi: torch.Tensor | None = None  # 1 − π of those slots, (batch, kv_heads, n_sampled_slots)
        self.compressed = False

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
            self._allocate(self.keys, self.values, self.log_pi, self.offset, self.positions,
                           max(2 * self.filled, self.filled + m))
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

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def derive(self, selections: list[Selection | None], oracle: bool, reserve: int = 0) -> CompressedLayer:
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

        layer = CompressedLayer(self.sliding_window)
        layer.scale, layer.device, layer.length, layer.is_initialized = self.scale, self.device, self.length, True
        layer._allocate(gather(self.keys), gather(self.values), log_pi, offset_bias(log_pi), gather(self.positions),
                        k_max + reserve)
        layer.n_prefix_slots = k_max
        layer.n_sampled_slots = n_sampled
        layer.one_minus_pi = tail_weight(log_pi[..., :n_sampled]).contiguous()
        layer.compressed = any(sel is not None for sel in selections)
        if oracle and layer.compressed:
            layer.prefix_keys, layer.prefix_values = self.keys, self.values
        return layer


class CompressedCache(Cache):
    """A cache of ``CompressedLayer``s plus what the attention function should compute and record.

    certify: compute tr V̂ per step on compressed layers; oracle: keep the full cache beside and compute
    the true error; records: one ``StepRecord`` per forward pass over compressed layers. kernel: the
    compiled ``hajek_step`` the attention function uses where it applies (None: the PyTorch path).
    """

    def __init__(self, layers: list[CompressedLayer], *, certify: bool = False, oracle: bool = False):
        super().__init__(layers=layers)
        self.certify = certify
        self.oracle = oracle
        self.kernel = hajek_step_op() if certify or oracle else None
        self._records: list[StepRecord] = []
        self._pending: list[_PendingStep] = []
        self._moments: dict[tuple[int, ...], TailMoments] = {}
        self.compressed_length = max((layer.length for layer in layers), default=0)

    def add_step(self, layer: int, shape: tuple[int, ...], out: torch.Tensor, tail_weights: torch.Tensor | None,
                 full_out: torch.Tensor | None, var: torch.Tensor | None = None) -> None:
        """Called by the attention function after each certified call on layer ``layer``.

        out/full_out: (batch·kv_heads, group·m, dv) with shape = (batch, kv_heads, group, m, dv);
        tail_weights: (batch·kv_heads, group·m, t), the weights of the layer's first t = n_sampled_slots
        slots, or None when var, (batch·kv_heads, group·m, dv), is given. Nothing is computed here: the
        variance and the statistics of a whole forward pass are computed at once when the pass is complete
        (the next pass starts, or ``records`` is read), a few kernels per step instead of a few per layer,
        off the attention's critical path.
        """
        if self._pending and layer <= self._pending[-1].layer:
            self._flush()
        first_step = self.layers[layer].length - shape[3] - self.compressed_length
        self._pending.append(_PendingStep(layer, first_step, shape, out, tail_weights, full_out, var))

    def _flush(self) -> None:
        groups: dict[tuple, list[_PendingStep]] = {}
        for step in self._pending:
            groups.setdefault((step.first_step, step.shape, step.full_out is None), []).append(step)
        self._records.extend(self._summarize(steps) for steps in groups.values())
        self._pending = []

    def _tail_moments(self, layers: tuple[int, ...], dtype: torch.dtype) -> TailMoments:
        """TailMoments of the sampled slots of ``layers``, stacked: (L, batch·kv_heads, ·, ·), padded to the
        longest tail with zero weight. The sampled slots never change, so this is computed once per group."""
        if layers not in self._moments:
            first = self.layers[layers[0]]
            t_max = max(self.layers[i].n_sampled_slots for i in layers)
            rows, dv = first.values.shape[0] * first.values.shape[1], first.values.shape[-1]
            values = first.values.new_zeros((len(layers), rows, t_max, dv), dtype=dtype)
            one_minus_pi = values.new_zeros((len(layers), rows, t_max))
            for j, i in enumerate(layers):
                layer, t = self.layers[i], self.layers[i].n_sampled_slots
                values[j, :, :t] = layer.values[:, :, :t].flatten(0, 1)
                one_minus_pi[j, :, :t] = layer.one_minus_pi.flatten(0, 1)
            self._moments[layers] = tail_moments(values, one_minus_pi, per_coordinate=self.oracle)
        return self._moments[layers]

    def _variance(self, steps: list[_PendingStep], out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The variance of each call, (L, batch·kv_heads, group·m, width): width dv per coordinate (oracle, or
        every call computed by the kernel), else 1 (the trace). out: the calls' outputs, stacked; shape:
        (L, batch, kv_heads, group, m, dv)."""
        if all(s.var is not None for s in steps):
            return _stack_rows([s.var for s in steps], shape)
        fused = [i for i, s in enumerate(steps) if s.var is not None]
        pending = [i for i, s in enumerate(steps) if s.var is None]
        tail = self._tail_moments(tuple(steps[i].layer for i in pending), out.dtype)
        weights = out.new_zeros((len(pending), *out.shape[1:-1], tail.one_minus_pi.shape[-1]))
        for j, i in enumerate(pending):
            weights[j, ..., : steps[i].tail_weights.shape[-1]] = steps[i].tail_weights
        computed = linearized_variance(weights, out[pending], tail)
        if not fused:
            return computed
        var = computed.new_empty((len(steps), *computed.shape[1:]))
        var[pending] = computed
        for i in fused:
            v = steps[i].var.reshape(var.shape[1:-1] + steps[i].var.shape[-1:])
            var[i] = v if tail.per_coordinate else v.sum(-1, keepdim=True)
        return var

    def _summarize(self, steps: list[_PendingStep]) -> StepRecord:
        """The StepRecord of the calls of one pass (same first_step and shape), computed for all layers at once."""
        shape = (len(steps), *steps[0].shape)  # (L, batch, kv_heads, group, m, dv)
        layers = tuple(s.layer for s in steps)
        out = _stack_rows([s.out for s in steps], shape)  # (L, batch·kv_heads, group·m, dv)
        var = self._variance(steps, out, shape).reshape(*shape[:-1], -1)
        out = out.reshape(shape)
        reduce = (3, 5)  # the group's query heads and the value coordinates form one vector per KV head
        record = StepRecord(
            layers=layers,
            first_step=steps[0].first_step,
            trace_var=var.sum(dim=reduce).float(),
            out_norm=torch.linalg.vector_norm(out, dim=reduce).float(),
        )
        if steps[0].full_out is not None:
            err = out - torch.stack([s.full_out.to(out.dtype) for s in steps]).reshape(shape)
            record.true_err = torch.linalg.vector_norm(err, dim=reduce).float()
            record.wald_coverage = (err.abs() <= WALD_Z * var.sqrt()).float().mean(dim=reduce)
        return record

    @property
    def records(self) -> list[StepRecord]:
        """The ``StepRecord``s of every pass so far (completing the current one)."""
        if self._pending:
            self._flush()
        return self._records

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
        self, selections: list[Selection] | None, *, certify: bool = False, oracle: bool = False, reserve: int = 0
    ) -> CompressedCache:
        """A new cache for one configuration: per-layer ``selections``, or None for the full cache."""
        return self.derive_batch([selections], certify=certify, oracle=oracle, reserve=reserve)

    def derive_batch(
        self,
        configurations: list[list[Selection] | None],
        *,
        certify: bool = False,
        oracle: bool = False,
        reserve: int = 0,
    ) -> CompressedCache:
        """A new cache with one batch row per configuration; this (prefill) cache is left untouched.

        configurations: per row, the per-layer Selections, or None for the full cache. ``reserve``: slots
        of spare capacity for the tokens that will be appended.
        """
        layers = [
            layer.derive([None if rows is None else rows[i] for rows in configurations], oracle=oracle, reserve=reserve)
            for i, layer in enumerate(self.layers)
        ]
        return CompressedCache(layers, certify=certify, oracle=oracle)


__all__ = ["CompressedCache", "CompressedLayer", "Observation", "StepRecord", "active_cache"]

"""The kvcert attention function, registered through ``transformers.AttentionInterface``.

The model's attention modules call it with post-RoPE queries and the slots the ``CompressedCache`` layer
returned; the cache itself arrives as the ``kvcert_cache`` keyword that ``model(...)`` / ``generate(...)``
forward to attention functions. Query heads are grouped by KV head (GQA) without repeating keys:
queries (batch, q_heads, m, d) become (batch, kv_heads, group·m, d).

Modes, by the layer's state:
* prefill (the layer observes): causal attention; record the window queries and accumulated attention;
* full cache: causal attention over all slots;
* compressed: attention with the Hájek offset −log π; when the cache certifies (or is an oracle), the
  Hájek estimator of ``kvcert.estimator`` runs in float32 and hands its output and the weights of the
  sampled slots to the cache, which computes the variance and the statistics of a whole forward pass at
  once (one ``StepRecord`` per pass).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .cache import CompressedCache, CompressedLayer, active_cache
from .estimator import compute_dtype, hajek_with_weights

ATTENTION_NAME = "kvcert"
CACHE_KWARG = "kvcert_cache"
_H2O_CHUNK = 256


def _allowed(k_pos: torch.Tensor, q_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility: k_pos (..., n), q_pos (..., m) -> (..., m, n) bool."""
    allowed = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if sliding_window is not None:
        allowed &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - sliding_window
    return allowed


def _mask_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _group(bias: torch.Tensor, group: int) -> torch.Tensor:
    """(b, kv_heads, m, n) -> (b, kv_heads, group·m, n), matching grouped queries; m = 1 broadcasts."""
    if bias.shape[-2] == 1:
        return bias
    b, h, m, n = bias.shape
    return bias.unsqueeze(2).expand(b, h, group, m, n).reshape(b, h, group * m, n)


def _observe(layer: CompressedLayer, query: torch.Tensor, key: torch.Tensor, scale: float, sliding: int | None):
    """Record the last window queries and, if asked, the attention each key received during prefill."""
    obs = layer.observation
    queries = query.detach()
    if obs.window_queries is not None:
        queries = torch.cat([obs.window_queries, queries], dim=-2)
    obs.window_queries = queries[..., -obs.window :, :].clone()
    if not obs.accumulate:
        return
    b, hq, m, _ = query.shape
    n = key.shape[-2]
    keys = key.detach().float().repeat_interleave(hq // key.shape[1], dim=1)
    k_pos = layer.positions[0, 0]
    q_pos_all = k_pos[-m:]
    total = torch.zeros((b, hq, n), dtype=torch.float32, device=key.device)
    for start in range(0, m, _H2O_CHUNK):
        q = query[..., start : start + _H2O_CHUNK, :].detach().float()
        logits = torch.matmul(q, keys.transpose(-1, -2)) * scale
        allowed = _allowed(k_pos, q_pos_all[start : start + _H2O_CHUNK], sliding)
        total += torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).sum(-2)
    if obs.accumulated_attention is not None:
        total[..., : obs.accumulated_attention.shape[-1]] += obs.accumulated_attention
    obs.accumulated_attention = total


def _shared_matmul(x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """x (b, h, r, c) @ shared (1, h, c, s) -> (b, h, r, s), folding the batch into rows.

    Broadcasting a batch-1 operand makes torch.matmul copy it once per row; folding avoids the copies.
    """
    b, h, r, c = x.shape
    folded = x.transpose(0, 1).reshape(1, h, b * r, c)
    return torch.matmul(folded, shared).reshape(h, b, r, -1).transpose(0, 1)


def _full_attention(grouped_q, layer: CompressedLayer, q_pos, sliding, scale: float, group: int) -> torch.Tensor:
    """The oracle: the same grouped queries over the uncompressed prefix plus the appended tokens.

    grouped_q: (b, kv_heads, group·m, d); the prefix (1, kv_heads, n, d) is shared by all batch rows, the
    appended slots are the layer's slots after ``n_prefix_slots``. Returns (b, kv_heads, group·m, dv).
    """
    dtype = compute_dtype(grouped_q, layer.prefix_keys)
    q = grouped_q.to(dtype)
    k0 = layer.n_prefix_slots
    n = layer.prefix_keys.shape[-2]
    need_mask = q_pos.shape[-1] > 1 or sliding is not None
    prefix = _shared_matmul(q, layer.prefix_keys.to(dtype).transpose(-1, -2)) * scale
    if need_mask:
        prefix = prefix + _group(_mask_bias(_allowed(torch.arange(n, device=q.device), q_pos, sliding), dtype), group)
    appended = torch.matmul(q, layer.keys[:, :, k0:].to(dtype).transpose(-1, -2)) * scale
    if need_mask:
        appended = appended + _group(_mask_bias(_allowed(layer.positions[:, :, k0:], q_pos, sliding), dtype), group)
    weights = torch.softmax(torch.cat([prefix, appended], dim=-1), dim=-1)
    return _shared_matmul(weights[..., :n], layer.prefix_values.to(dtype)) + torch.matmul(
        weights[..., n:], layer.values[:, :, k0:].to(dtype)
    )


def kvcert_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a ``CompressedCache`` layer.

    query: (batch, q_heads, m, d); key/value: (batch, kv_heads, slots, d) as returned by the cache layer.
    Returns (batch, m, q_heads, d) in the query dtype, and no attention weights.
    """
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("kvcert attention does not support attention logit soft-capping")
    b, hq, m, d = query.shape
    hk = key.shape[1]
    group = hq // hk
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(d)
    cache = kwargs.get(CACHE_KWARG)
    if not isinstance(cache, CompressedCache):
        cache = active_cache(module.layer_idx, key)  # e.g. model.generate(cache=...), which drops kvcert_cache
    layer = cache.layers[module.layer_idx] if isinstance(cache, CompressedCache) else None
    sliding = kwargs.get("sliding_window")
    if layer is None:
        # No kvcert cache: plain causal attention over whatever the model's own cache returned.
        n = key.shape[-2]
        k_pos = torch.arange(n, device=key.device)
        bias = _mask_bias(_allowed(k_pos, k_pos[n - m :], sliding), query.dtype)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    if layer.observation is not None:
        layer.sliding_window, layer.scale = sliding, scale
        _observe(layer, query, key, scale, sliding)

    if not layer.compressed and sliding is None and m == key.shape[-2] and m > 1:
        # A whole uncompressed prefix at once (the prefill): plain causal attention, no explicit mask.
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    q_pos = layer.positions[..., -m:]  # (b, kv_heads, m)
    bias = None
    if m > 1 or sliding is not None:
        bias = _mask_bias(_allowed(layer.positions, q_pos, sliding), torch.float32)
    if layer.compressed:
        offset = layer.offset.unsqueeze(-2)  # (b, kv_heads, 1, slots)
        bias = offset if bias is None else bias + offset
    grouped_q = query.reshape(b, hk, group * m, d)
    grouped_bias = _group(bias, group) if bias is not None else None

    if layer.compressed and (cache.certify or cache.oracle):
        # (b, kv_heads, ·, ·) -> (b·kv_heads, ·, ·): views, so that every matmul is one bmm
        flat = lambda t: t.reshape(b * hk, *t.shape[2:])  # noqa: E731
        full_out = None
        if cache.oracle and layer.prefix_keys is not None:
            full_out = flat(_full_attention(grouped_q, layer, q_pos, sliding, scale, group))
        shape = (b, hk, group, m, value.shape[-1])
        if cache.kernel is not None and query.dtype == torch.float32 and query.device.type == "cpu":
            # One compiled pass gives the output and the per-coordinate variance (kvcert.kernels); the
            # cache's keys and values are float32 too (they are the model's).
            out, var = cache.kernel(grouped_q, key, value, grouped_bias, layer.one_minus_pi, scale)
            cache.add_step(module.layer_idx, shape, out, None, full_out, var=var)
        else:
            # Rows are never empty here: every query sees itself (an appended, certain slot).
            out, weights = hajek_with_weights(flat(grouped_q), flat(key), flat(value), flat(grouped_bias), scale,
                                              check_empty=False)
            # Only the first n_sampled_slots slots can have π < 1 (derive sorts them first); the cache computes
            # the variance from their weights once the forward pass is complete.
            cache.add_step(module.layer_idx, shape, out, weights[..., : layer.n_sampled_slots], full_out)
    else:
        mask = grouped_bias.to(query.dtype) if grouped_bias is not None else None
        out = F.scaled_dot_product_attention(grouped_q, key, value, attn_mask=mask, scale=scale)
    out = out.to(query.dtype).reshape(b, hq, m, -1)
    return out.transpose(1, 2).contiguous(), None


def prepare_model(model):
    """Register the kvcert attention function and switch ``model`` to it; returns the model."""
    AttentionInterface.register(ATTENTION_NAME, kvcert_attention)
    model.set_attn_implementation(ATTENTION_NAME)
    return model

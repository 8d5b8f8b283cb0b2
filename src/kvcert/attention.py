"""The kvcert attention function, registered through ``transformers.AttentionInterface``, and ``attach``,
the scoped way a model uses it.

The model's attention modules call ``kvcert_attention`` with post-RoPE queries and the slots the cache
layer returned; the ``AttentionContext`` (``kvcert.context``: the ``CompressedCache`` and what the pass does
beside attending) arrives as the ``kvcert_context`` keyword that ``model(...)`` forwards to attention
functions, or is bound by ``attach(model, context)`` for calls that drop unknown keywords (``model.generate``).
Query heads are grouped by KV head (GQA) without repeating keys: queries (batch, q_heads, m, d) become
(batch, kv_heads, group·m, d). One small function per mode:

* ``plain_attention``: no kvcert cache (the model used normally while attached): causal attention, or
  the model's own mask when a batch is padded;
* ``prefill_attention``: a layer that observes (the prefill): record the observation window's queries, the
  output projection, and where asked the attention each key receives (H2O, ObservedAttention) and the
  queries' statistics before RoPE (ExpectedAttention); then causal attention;
* ``full_cache_attention``: an uncompressed layer: causal (and sliding-window) attention over its slots;
* ``compressed_attention``: the Hájek offset −log π as an additive bias (docs/METHOD.md §3);
* ``certified_attention``: the same estimate computed in float32 with its variance, in the same call (the
  compiled kernel, the Triton one, or ``kvcert.estimator.hajek_with_variance``), handed per query row to the
  decoding's ``CertificateRecorder`` (docs/METHOD.md §4).

In both compressed modes the batch rows of a decode-time sampler (design ``clt``: every slot kept) get the
sampler's estimate instead (``_sampled_rows``), before the recorder sees them.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import CompressedCache, CompressedLayer
from .context import AttentionContext, Observation
from .estimator import compute_dtype, hajek_with_variance

ATTENTION_NAME = "kvcert"
CONTEXT_KWARG = "kvcert_context"
_H2O_CHUNK = 256


# --- masks ----------------------------------------------------------------------------------------------


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


def padding_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask transformers builds for kvcert attention: None unless the batch is padded.

    kvcert builds causal and sliding-window masks itself from slot positions; a padded batch is the one
    thing it cannot know, so only then is a (batch, 1, q, kv) mask made (as for SDPA), which
    ``plain_attention`` applies and a compressed cache refuses.
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return sdpa_mask(attention_mask=attention_mask, **{**kwargs, "allow_is_causal_skip": False})


# --- modes ----------------------------------------------------------------------------------------------


def plain_attention(module, query, key, value, attention_mask, scale: float, sliding: int | None, **kwargs):
    """No kvcert cache: causal attention over whatever the model's own cache returned, (b, hq, m, d).

    A padded batch arrives with the model's own mask and runs exactly as stock SDPA attention does.
    """
    if attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale,
                                        sliding_window=sliding, **kwargs)
        return out.transpose(1, 2)
    m, n = query.shape[-2], key.shape[-2]
    k_pos = torch.arange(n, device=key.device)
    bias = _mask_bias(_allowed(k_pos, k_pos[n - m:], sliding), query.dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale, enable_gqa=True)


def _observe(module, obs: Observation, layer: CompressedLayer, query: torch.Tensor, key: torch.Tensor, scale: float,
             sliding: int | None):
    """Record the last window queries, the output projection and, if asked, the queries' statistics before RoPE
    and the attention each key received during prefill."""
    obs.scale, obs.sliding_window = scale, sliding
    projection = getattr(module, "o_proj", None)
    obs.output_projection = projection.weight.detach() if projection is not None else None
    queries = query.detach()
    if obs.window_queries is not None:
        queries = torch.cat([obs.window_queries, queries], dim=-2)
    obs.window_queries = queries[..., -obs.window:, :].clone()
    b, hq, m, _ = query.shape
    k_pos = layer.positions[0, 0]
    q_pos_all = k_pos[-m:]
    if obs.query_statistics is not None:
        obs.query_statistics.add(query.detach(), q_pos_all)
    if not obs.accumulate:
        return
    n = key.shape[-2]
    keys = key.detach().float().repeat_interleave(hq // key.shape[1], dim=1)
    total = torch.zeros((b, hq, n), dtype=torch.float32, device=key.device)
    for start in range(0, m, _H2O_CHUNK):
        q = query[..., start: start + _H2O_CHUNK, :].detach().float()
        logits = torch.matmul(q, keys.transpose(-1, -2)) * scale
        allowed = _allowed(k_pos, q_pos_all[start: start + _H2O_CHUNK], sliding)
        total += torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).sum(-2)
    if obs.accumulated_attention is not None:
        total[..., : obs.accumulated_attention.shape[-1]] += obs.accumulated_attention
    obs.accumulated_attention = total


def prefill_attention(module, obs: Observation, layer: CompressedLayer, query, key, value, scale: float,
                      sliding: int | None):
    """An observed layer: record what the policies need, then causal attention, (b, hq, m, d)."""
    _observe(module, obs, layer, query, key, scale, sliding)
    m = query.shape[-2]
    if sliding is None and m == key.shape[-2] and m > 1:
        # A whole uncompressed prefix at once: plain causal attention, no explicit mask.
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
    return full_cache_attention(layer, query, key, value, scale, sliding)


def _grouped(layer: CompressedLayer, query: torch.Tensor, sliding: int | None, offset: bool):
    """Queries grouped by KV head (b, kv_heads, group·m, d), their positions (b, kv_heads, m) and the additive
    bias (b, kv_heads, group·m or 1, slots) in float32: the causal/window mask where needed (several query
    positions, or a window), plus −log π when ``offset``; None when nothing is masked or offset."""
    b, hq, m, d = query.shape
    hk = layer.keys.shape[1]
    group = hq // hk
    q_pos = layer.positions[..., -m:]
    bias = None
    if m > 1 or sliding is not None:
        bias = _mask_bias(_allowed(layer.positions, q_pos, sliding), torch.float32)
    if offset:
        offset_bias = layer.offset.unsqueeze(-2)  # (b, kv_heads, 1, slots)
        bias = offset_bias if bias is None else bias + offset_bias
    grouped_bias = _group(bias, group) if bias is not None else None
    return query.reshape(b, hk, group * m, d), q_pos, grouped_bias


def _grouped_sdpa(grouped_q, key, value, grouped_bias, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """SDPA of the grouped queries (b, kv_heads, group·m, d) with the bias cast to ``dtype`` (the query's):
    (b, kv_heads, group·m, dv)."""
    mask = grouped_bias.to(dtype) if grouped_bias is not None else None
    return F.scaled_dot_product_attention(grouped_q, key, value, attn_mask=mask, scale=scale)


def _ungroup(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(b, kv_heads, group·m, dv) -> (b, hq, m, dv) in the query's dtype."""
    return out.to(query.dtype).reshape(*query.shape[:-1], -1)


def full_cache_attention(layer: CompressedLayer, query, key, value, scale: float, sliding: int | None):
    """An uncompressed layer: attention over all its slots with the causal/window mask, (b, hq, m, d)."""
    grouped_q, _, grouped_bias = _grouped(layer, query, sliding, offset=False)
    return _ungroup(_grouped_sdpa(grouped_q, key, value, grouped_bias, query.dtype, scale), query)


def compressed_attention(layer: CompressedLayer, query, key, value, scale: float, sliding: int | None,
                         ctx: AttentionContext | None = None, layer_idx: int | None = None):
    """A compressed layer without certificate: the Hájek offset −log π as an additive bias, (b, hq, m, d); the
    rows of ``ctx``'s decode-time samplers get their sample's estimate."""
    grouped_q, q_pos, grouped_bias = _grouped(layer, query, sliding, offset=True)
    out = _grouped_sdpa(grouped_q, key, value, grouped_bias, query.dtype, scale)
    if ctx is not None and ctx.samplers:
        out = _sampled_rows(ctx, layer_idx, layer, grouped_q, q_pos, out, scale, sliding)
    return _ungroup(out, query)


def _sampled_rows(ctx: AttentionContext, layer_idx: int, layer: CompressedLayer, grouped_q: torch.Tensor,
                  q_pos: torch.Tensor, out: torch.Tensor, scale: float, sliding: int | None) -> torch.Tensor:
    """A copy of ``out`` (b, kv_heads, group·m, dv) with each row of ``ctx.samplers`` (callers check that there is
    one) replaced by its sampler's estimate.

    grouped_q: (b, kv_heads, group·m, d); q_pos: (b, kv_heads, m), the query positions (a grouped row g·m + t is
    query position t).
    """
    out = out.clone()
    group = grouped_q.shape[2] // q_pos.shape[-1]
    for row, samplers in ctx.samplers.items():
        rows_pos = q_pos[row].repeat(1, group)  # (kv_heads, group·m)
        allowed = _allowed(layer.positions[row], rows_pos, sliding)  # (kv_heads, group·m, slots)
        allowed &= torch.isfinite(layer.log_pi[row]).unsqueeze(1)
        estimate = samplers[layer_idx].attend(grouped_q[row], layer.keys[row], layer.values[row], layer.positions[row],
                                              allowed, rows_pos, scale)
        out[row] = estimate.to(out.dtype)
    return out


def _oracle_attention(grouped_q, layer: CompressedLayer, prefix_layer: CompressedLayer, q_pos, sliding, scale: float,
                      group: int) -> torch.Tensor:
    """The oracle: the same grouped queries over the uncompressed prefix plus the appended tokens.

    grouped_q: (b, kv_heads, group·m, d); the prefix, ``prefix_layer``'s slots (1, kv_heads, n, d), is shared by
    all batch rows; the appended slots are ``layer``'s slots after ``n_prefix_slots``. Returns (b, kv_heads,
    group·m, dv).
    """
    prefix_keys, prefix_values = prefix_layer.keys, prefix_layer.values
    dtype = compute_dtype(grouped_q, prefix_keys)
    q = grouped_q.to(dtype)
    k0 = layer.n_prefix_slots
    n = prefix_keys.shape[-2]
    need_mask = q_pos.shape[-1] > 1 or sliding is not None
    prefix = _shared_matmul(q, prefix_keys.to(dtype).transpose(-1, -2)) * scale
    if need_mask:
        prefix = prefix + _group(_mask_bias(_allowed(torch.arange(n, device=q.device), q_pos, sliding), dtype), group)
    appended = torch.matmul(q, layer.keys[:, :, k0:].to(dtype).transpose(-1, -2)) * scale
    if need_mask:
        appended = appended + _group(_mask_bias(_allowed(layer.positions[:, :, k0:], q_pos, sliding), dtype), group)
    weights = torch.softmax(torch.cat([prefix, appended], dim=-1), dim=-1)
    return _shared_matmul(weights[..., :n], prefix_values.to(dtype)) + torch.matmul(
        weights[..., n:], layer.values[:, :, k0:].to(dtype)
    )


def _shared_matmul(x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """x (b, h, r, c) @ shared (1, h, c, s) -> (b, h, r, s), folding the batch into rows.

    Broadcasting a batch-1 operand makes torch.matmul copy it once per row; folding avoids the copies.
    """
    b, h, r, c = x.shape
    folded = x.transpose(0, 1).reshape(1, h, b * r, c)
    return torch.matmul(folded, shared).reshape(h, b, r, -1).transpose(0, 1)


def certified_attention(ctx: AttentionContext, layer_idx: int, query, key, value, scale: float, sliding: int | None):
    """A compressed layer with certificate: the Hájek estimate in float32, its variance and the variance's
    term sums, computed in this call (by the compiled kernel where it applies, else by
    ``hajek_with_variance``) and handed per query row to the context's recorder, with the oracle's full-cache
    output when the context has an oracle. Returns (b, hq, m, d) in the query dtype."""
    layer = ctx.cache.layers[layer_idx]
    recorder = ctx.recorder
    b, hq, m, _ = query.shape
    hk = key.shape[1]
    grouped_q, q_pos, grouped_bias = _grouped(layer, query, sliding, offset=True)
    # (b, kv_heads, ·, ·) -> (b·kv_heads, ·, ·): views, so that every matmul is one bmm
    flat = lambda t: t.reshape(b * hk, *t.shape[2:])  # noqa: E731
    full_out = None
    if ctx.oracle is not None:
        full_out = flat(_oracle_attention(grouped_q, layer, ctx.oracle.layers[layer_idx], q_pos, sliding, scale,
                                          hq // hk))
    shape = (b, hk, hq // hk, m, value.shape[-1])
    tail_one_minus_pi = ctx.tail_one_minus_pi(layer_idx)  # (b, kv_heads, t): derive sorts sampled slots first
    if recorder.kernel is not None and recorder.path.accepts(query.shape[-1], value.shape[-1]):
        # (b, kv_heads, group·m, 2): Σc, Σc² per row
        terms = grouped_q.new_empty((*grouped_q.shape[:-1], 2), dtype=torch.float32)
        out, var = recorder.kernel(grouped_q, key, value, grouped_bias, tail_one_minus_pi, scale, terms)
    else:
        # Rows are never empty here: every query sees itself (an appended, certain slot).
        # per coordinate even without the oracle: the recorder sums the coordinates with the group's heads
        out, var, terms = hajek_with_variance(flat(grouped_q), flat(key), flat(value), flat(grouped_bias), scale,
                                              flat(tail_one_minus_pi), per_coordinate=True, check_empty=False)
    if ctx.samplers:  # design clt's rows: the decode-time sample's estimate (the recorder measures its error)
        out = _sampled_rows(ctx, layer_idx, layer, grouped_q, q_pos, out.reshape(b, hk, *out.shape[-2:]), scale,
                            sliding)
    recorder.add(layer_idx, layer.length, shape, out, var, terms, full_out)
    return _ungroup(out, query)


# --- dispatch -------------------------------------------------------------------------------------------


def kvcert_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    bound_context: AttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention as transformers calls it: query (batch, q_heads, m, d); key/value (batch, kv_heads, slots, d)
    as the cache layer returned them. Returns (batch, m, q_heads, d) in the query dtype, and no weights.

    The pass's ``AttentionContext`` (or a bare ``CompressedCache``) comes as the ``kvcert_context`` keyword, else
    ``bound_context`` (``attach(model, context)``); without either, the model attends as it normally would."""
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("kvcert attention does not support attention logit soft-capping")
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    sliding = kwargs.pop("sliding_window", None)
    ctx = kwargs.pop(CONTEXT_KWARG, None) or bound_context
    if isinstance(ctx, CompressedCache):
        ctx = AttentionContext(ctx)
    if ctx is None:
        out = plain_attention(module, query, key, value, attention_mask, scale, sliding, **kwargs)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None:
        raise ValueError("kvcert: a padded batch cannot attend to a CompressedCache (its rows are configurations "
                         "of one prompt); decode prompts one at a time")
    layer = ctx.cache.layers[module.layer_idx]
    if ctx.compressor is not None and ctx.observations is None:
        ctx.compressor.observe(module.layer_idx, query)  # the window queries of a decode-time compression
    if ctx.observations is not None:
        out = prefill_attention(module, ctx.observations[module.layer_idx], layer, query, key, value, scale, sliding)
    elif not layer.compressed:
        out = full_cache_attention(layer, query, key, value, scale, sliding)
    elif ctx.recorder is None:
        out = compressed_attention(layer, query, key, value, scale, sliding, ctx, module.layer_idx)
    else:
        out = certified_attention(ctx, module.layer_idx, query, key, value, scale, sliding)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the attention function and its mask function under ``ATTENTION_NAME``, once per process
    (a wrapper registered under the same name, e.g. by a test that records every call, is left in place)."""
    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, kvcert_attention)
    if ATTENTION_NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(ATTENTION_NAME, padding_mask)


@contextmanager
def attach(model, context: AttentionContext | CompressedCache | None = None) -> Iterator:
    """Inside the block, ``model`` runs kvcert attention; on exit, normal or by exception, its previous
    attention implementation is restored. ``kvcert.prefill``, ``decode`` and ``generate`` attach by themselves
    for their own forward passes and hand their context to every call.

    context: a ``CompressedCache`` (or ``AttentionContext``) that every call inside the block attends over
    unless the call brings its own ``kvcert_context``: what ``model.generate(..., cache=cache)``, which drops
    unknown keywords, needs (``with kvcert.attach(model, cache): model.generate(..., cache=cache)``). It is bound
    to the function registered as ``ATTENTION_NAME`` (kvcert's, or a wrapper of it), under a name of its own
    for the block, unregistered on exit. Nested use without a context is a no-op.
    """
    register()
    previous = model.config._attn_implementation
    if context is None and previous is not None and previous.startswith(ATTENTION_NAME):
        yield model
        return
    name = ATTENTION_NAME
    if context is not None:
        ctx = context if isinstance(context, AttentionContext) else AttentionContext(context)
        name = f"{ATTENTION_NAME}_{id(ctx):x}"
        function = AttentionInterface._global_mapping[ATTENTION_NAME]
        AttentionInterface.register(name, functools.partial(function, bound_context=ctx))
        AttentionMaskInterface.register(name, padding_mask)
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
        if name != ATTENTION_NAME:
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)


__all__ = ["ATTENTION_NAME", "CONTEXT_KWARG", "attach", "kvcert_attention", "register"]

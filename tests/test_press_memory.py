"""The press's cache memory: each layer compressed as soon as the prefill has run it, and slots for generated tokens
allocated on demand instead of a fixed reserve, with the answers and certificates of ``kvcert``'s own decode.

Runs on the tiny random-weight models of ``tests/helpers/tiny_models.py`` (no download); the growth rule of
``CompressedLayer`` is checked on its own (our own logic, no model).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from helpers.tiny_models import build, prompt
from transformers.cache_utils import Cache

import kvcert
from kvcert import cache as cache_module
from kvcert.cache import DECODE_CHUNK, CompressedLayer
from kvcert.generation import Configuration, decode_configurations
from kvcert.policies import prefill_needs
from kvcert.presses import PressCache

STEPS = 5


def _ids(seed: int = 3, n_context: int = 200) -> torch.Tensor:
    context, question = prompt(seed, n_context=n_context)
    return torch.cat([context, question], -1)


def _generate(model, ids: torch.Tensor, new_tokens: int = STEPS, **kwargs):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


def _buffer_bytes(layer) -> int:
    """Bytes a cache layer holds allocated: its keys, values, log π, offset and positions buffers, spare slots
    included."""
    return sum(t.numel() * t.element_size() for t in layer._buffers)


def _slot_bytes(layer) -> int:
    """Bytes of one slot of every KV head (one batch row) of a layer: keys, values, log π, offset, position."""
    k, v, lp, off, pos = layer._buffers
    heads = k.shape[1]
    return heads * (k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size() + lp.element_size()
                    + off.element_size() + pos.element_size())


@pytest.mark.parametrize("policy, design, allocator, options", [
    ("h2o", "poisson", "uniform", {}),  # accumulated attention
    ("expected_attention", "topk", "pyramidkv", {}),  # the queries' statistics; a per-layer schedule
    ("leverage", "poisson", "adakv", {}),  # keys before RoPE; heads pooled within a layer
    ("criticalkv", "poisson", "pyramidkv", {}),  # the output projection
    ("snapkv", "poisson", "uniform", {"head_attention_share": 0.5, "tail_mix": 0.2}),  # the window's attention
    ("knorm", "topk", "uniform", {}),
])
def test_compressing_layer_by_layer_gives_kvcerts_decode(policy, design, allocator, options):
    """Each layer compressed as the prefill leaves it: the same tokens, retained slots, bytes and step table as
    ``decode_configurations`` (which selects after the whole prefill), for every kind of observation a policy
    reads and every allocator."""
    _, model, _ = build("llama")
    ids = _ids()
    design_options = kvcert.DesignOptions(**options)
    press = kvcert.press(policy=policy, design=design, compression_ratio=0.6, seed=7, allocator=allocator,
                         options=design_options)
    assert press._layerwise
    with press(model):
        tokens = _generate(model, ids)[0, ids.shape[-1]:].tolist()
    state = kvcert.prefill(model, ids, **prefill_needs([policy]))
    expected, = decode_configurations(model, state, [Configuration(policy, design, press.budget, 7)],
                                      max_new_tokens=STEPS, stop_ids=set(), allocator=allocator,
                                      options=design_options)
    cert = press.certificate
    assert tokens == expected.token_ids
    assert cert.retained_tokens == expected.retained_tokens < ids.shape[-1]
    assert (cert.cache_bytes, cert.full_bytes, cert.kept_bytes) == (expected.cache_bytes, expected.full_bytes,
                                                                    expected.kept_bytes)
    pd.testing.assert_frame_equal(cert.steps, expected.steps)


@pytest.mark.parametrize("oracle", [False, True])
def test_a_layer_is_compressed_before_the_next_one_runs(oracle):
    """When layer i starts its prefill, every layer before it already holds only its kept slots (the full cache of
    one layer exists at a time); with the oracle (which keeps the full cache) the press still compresses after the
    whole prefill."""
    _, model, _ = build("llama")
    ids = _ids()
    n = ids.shape[-1]
    seen: list[list[int]] = []

    def before_layer(module, args, kwargs):
        cache = next((v for v in kwargs.values() if isinstance(v, Cache)), None)
        if cache is not None and len(seen) < len(model.model.layers):  # the prefill's passes only
            seen.append([layer.filled if layer.is_initialized else 0 for layer in cache.layers])

    press = kvcert.press(policy="snapkv", design="topk", compression_ratio=0.5, oracle=oracle)
    kept = kvcert.retained_count(press.budget, n)
    handles = [layer.register_forward_pre_hook(before_layer, with_kwargs=True) for layer in model.model.layers]
    try:
        with press(model):
            _generate(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == len(model.model.layers) >= 2
    for i, filled in enumerate(seen):
        assert filled[i:] == [0] * (len(filled) - i)  # not run yet
        assert filled[:i] == [n if oracle else kept] * i


@pytest.mark.parametrize("chunk, new_tokens", [(DECODE_CHUNK, STEPS), (4, 3 * 4 + 2)])
def test_the_cache_after_prefill_holds_the_kept_slots_and_at_most_a_chunk(chunk, new_tokens, monkeypatch):
    """Counted in bytes of the cache's tensors: after the prefill each layer holds its kept slots plus
    min(DECODE_CHUNK, max_new_tokens − 1) slots for generated tokens; at the end no more than the kept slots plus
    max_new_tokens (the slots grow on demand). Batch rows (a padded batch) get the same. The second case sets
    DECODE_CHUNK to 4 (a patched constant of our own) so that a short generation grows the slots several times."""
    monkeypatch.setattr(cache_module, "DECODE_CHUNK", chunk)
    _, model, _ = build("llama")
    ids = _ids()
    after_prefill: list[int] = []

    def after(module, args, kwargs, output):  # the first pass generate sees (not a batch row's own prefill)
        if not after_prefill and isinstance(output.cache, PressCache):
            after_prefill.extend(_buffer_bytes(layer) for layer in output.cache.layers)

    press = kvcert.press(policy="snapkv", design="topk", compression_ratio=0.5)
    kept = kvcert.retained_count(press.budget, ids.shape[-1])
    with press(model):
        handle = model.register_forward_hook(after, with_kwargs=True)  # runs after the press's own hook
        try:
            out = _generate(model, ids, new_tokens, return_dict_in_generate=True)
        finally:
            handle.remove()
    layers = out.cache.layers
    reserve = min(chunk, new_tokens - 1)
    assert after_prefill == [(kept + reserve) * _slot_bytes(layer) for layer in layers]
    for layer in layers:
        assert layer.filled == kept + new_tokens - 1
        assert layer.filled <= layer._buffers[0].shape[2] <= kept + new_tokens
    assert press.certificate.cache_bytes == sum((kept * _slot_bytes(layer)) for layer in layers)

    short, longer = _ids(4, n_context=120), _ids(5, n_context=160)
    n = max(short.shape[-1], longer.shape[-1])
    batch = torch.stack([F.pad(p[0], (n - p.shape[-1], 0)) for p in (short, longer)])
    mask = torch.stack([F.pad(torch.ones_like(p[0]), (n - p.shape[-1], 0)) for p in (short, longer)])
    after_prefill.clear()
    with press(model):
        handle = model.register_forward_hook(after, with_kwargs=True)
        try:
            out = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
        finally:
            handle.remove()
    widest = kvcert.retained_count(press.budget, longer.shape[-1])
    assert after_prefill == [(widest + reserve) * 2 * _slot_bytes(layer) for layer in out.cache.layers]


def test_decode_slots_grow_by_chunks_up_to_the_token_limit():
    """Our own growth rule, no model: a layer set to grow on demand reallocates by max(chunk, an eighth) slots,
    never past its prefix slots plus the token limit; left at its default it doubles (kvcert.generate's decode
    reserves every slot up front and never grows)."""
    def layer_of(prefix: int, reserve: int) -> CompressedLayer:
        layer = CompressedLayer()
        layer.device, layer.is_initialized, layer.length = torch.device("cpu"), True, prefix
        keys = torch.zeros(1, 2, prefix, 4)
        zeros = torch.zeros(1, 2, prefix)
        layer._allocate(keys, keys.clone(), zeros, zeros.clone(), zeros.long(), prefix + reserve)
        layer.n_prefix_slots = prefix
        return layer

    def capacities(layer: CompressedLayer, tokens: int) -> list[int]:
        seen = []
        for _ in range(tokens):
            layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
            seen.append(layer._buffers[0].shape[2])
        return seen

    grown = layer_of(40, 4)
    grown.grow_on_demand(30, chunk=8)
    seen = capacities(grown, 30)
    assert sorted(set(seen)) == [44, 52, 60, 68, 70]  # chunks of 8, then capped at 40 + 30
    assert grown.filled == 70 and grown.keys[0, 0, 40:].eq(1).all()
    big = layer_of(400, 0)
    big.grow_on_demand(None, chunk=8)
    assert capacities(big, 1) == [400 + 401 // 8]  # an eighth of the cache once that exceeds the chunk
    doubling = layer_of(40, 4)
    assert sorted(set(capacities(doubling, 10))) == [44, 88]

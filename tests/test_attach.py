"""``kvcert.attach``: kvcert attention inside a block only, and padded batches handled or refused.

A tiny random-weight Llama (and Gemma3, with sliding-window layers) built from configs; the stock model
with SDPA attention is the reference.
"""

from __future__ import annotations

import pytest
import torch
from test_generation_tiny import _build, _prompt

import kvcert
from kvcert.attention import ATTENTION_NAME, CONTEXT_KWARG


def test_attach_restores_the_implementation_on_exit():
    _, model, _ = _build("llama")
    assert model.config._attn_implementation == "sdpa"
    with kvcert.attach(model):
        assert model.config._attn_implementation == ATTENTION_NAME
        with kvcert.attach(model):  # nested: a no-op
            assert model.config._attn_implementation == ATTENTION_NAME
        assert model.config._attn_implementation == ATTENTION_NAME
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with kvcert.attach(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with kvcert.attach(model):
        pass
    assert model.config._attn_implementation == "eager"


def test_prefill_decode_and_generate_leave_the_model_as_they_found_it():
    _, model, _ = _build("llama")
    context, question = _prompt(3, n_context=80)
    state = kvcert.prefill(model, context, question, setting="streaming")
    assert model.config._attn_implementation == "sdpa"
    kvcert.decode(model, state, kvcert.select(state, "snapkv", "poisson", 0.5, seed=1), max_new_tokens=3)
    assert model.config._attn_implementation == "sdpa"
    # a plain forward afterwards is the stock model's
    reference, _, _ = _build("llama")
    ids = torch.cat([context, question], -1)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_padded_batch_on_an_attached_model_matches_stock_attention(arch):
    """The model used normally while attached (no kvcert cache): padding is applied exactly as stock SDPA
    does, sliding-window layers included; the padded row's real tokens get the stock logits."""
    reference, model, _ = _build(arch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding of the second row
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        with kvcert.attach(model):
            got = model(input_ids=ids, attention_mask=mask).logits
            unpadded = model(input_ids=ids).logits
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, 7:], expected[1, 7:], rtol=0, atol=1e-5)
    # without the mask the second row differs: the test does exercise the padding
    assert float((unpadded[1, 7:] - expected[1, 7:]).abs().max()) > 1e-3


def test_a_padded_batch_on_a_compressed_cache_is_refused():
    _, model, _ = _build("llama")
    context, question = _prompt(4, n_context=80)
    state = kvcert.prefill(model, context, question, setting="streaming")
    selections = kvcert.select(state, "snapkv", "topk", 0.5)
    cache = state.cache.derive_batch([selections, selections])
    ids = torch.cat([question, question])
    n = state.context_tokens + question.shape[-1]
    mask = torch.ones((2, n), dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad(), kvcert.attach(model):
        with pytest.raises(ValueError, match="a padded batch cannot attend to a CompressedCache"):
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, **{CONTEXT_KWARG: cache})

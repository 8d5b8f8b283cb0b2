"""Compression during long generations (``max_cache_tokens``): the cache stays under its bound under stock
``model.generate``, every re-compression compounds the stages' inclusion probabilities into the logit offset, the
certificate and the oracle keep working, and a bound that leaves no room is refused before anything runs.

The checks of our own bookkeeping run on the tiny random-weight models of ``tests/helpers/tiny_models.py`` (no
download); the bound under stock generate on the bundled model is marked ``smollm2`` (the session's SmolLM2 of
``tests/conftest.py``).
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from helpers.tiny_models import build, prompt

import kvcert
from kvcert.decode_compression import (DecodeCompressor, check_decode_bound, compound_log_pi, recording_thinnings,
                                       thin_head)
from kvcert.generation import Configuration, decode_configurations, eos_ids, item_seed
from kvcert.policies import LayerView, get_policy
from kvcert.run_schema import DesignOptions
from kvcert.sampling import inclusion_probabilities, poisson_sample
from kvcert.theory import passkey_prompt

OPTIONS = DesignOptions()
BOUND, INTERVAL = 96, 16


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: these decodes are small, and on shared cores threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_ids(n_context: int = 200) -> torch.Tensor:
    context, question = prompt(3, n_context=n_context)
    return torch.cat([context, question], -1)


def _decode(model, state, design: str, steps: int, *, seed: int = 7, oracle: bool = True):
    bound = check_decode_bound(BOUND, INTERVAL, policy="snapkv", design=design, options=OPTIONS)
    selections = kvcert.select(state, "snapkv", design, 0.5, seed)
    compressor = DecodeCompressor(bound, policy="snapkv", design=design, options=OPTIONS, seed=seed,
                                  policy_options=None, observations=state.observations,
                                  window=state.observations[0].window)
    decoding = kvcert.Decoding(model, state, [selections], max_new_tokens=steps, stop_ids=set(), oracle=oracle,
                               compressor=compressor)
    while decoding.advance():
        pass
    return decoding, selections


def test_the_compound_offset_is_the_product_of_the_stages_probabilities():
    """Every slot left in the cache after several compressions carries −log(π_prefill · π_2 · … · π_k), the product
    of its stages' probabilities recomputed in float64 from the prefill's selection and each compression's log,
    matched by position; slots appended since the last compression carry 0."""
    _, model, _ = build("llama")
    state = kvcert.prefill(model, _tiny_ids())
    with recording_thinnings() as log:
        decoding, selections = _decode(model, state, "poisson", 64)
    for i, layer in enumerate(decoding.cache.layers):
        events = [t for t in log if t.layer == i]
        assert len(events) >= 3  # the prefill's 103 slots, then every 16 tokens
        for g in range(layer.keys.shape[1]):
            first = {int(p): float(lp) for p, lp in zip(selections[i].index[0, g], selections[i].log_pi[0, g])
                     if math.isfinite(lp)}
            stages = [{int(p): float(lp) for p, lp in zip(t.positions[g], t.stage_log_pi[g]) if p >= 0}
                      for t in events]
            sampled_twice = 0
            for slot in range(layer.filled):
                log_pi = float(layer.log_pi[0, g, slot])
                if not math.isfinite(log_pi):
                    continue
                pos = int(layer.positions[0, g, slot])
                if pos >= events[-1].length:  # appended after the last compression
                    assert log_pi == 0.0 and float(layer.offset[0, g, slot]) == 0.0
                    continue
                assert pos in first or pos >= state.context_tokens  # a prompt slot the prefill kept, or generated
                factors = [first.get(pos, 0.0)] + [stage[pos] for t, stage in zip(events, stages) if pos < t.length]
                pi = torch.ones((), dtype=torch.float64)
                for factor in factors:
                    pi = pi * torch.tensor(factor, dtype=torch.float64).exp()
                sampled_twice += sum(factor < 0 for factor in factors) >= 2
                assert float(layer.offset[0, g, slot]) == pytest.approx(float(-torch.log(pi)), rel=1e-6, abs=1e-6)
            assert sampled_twice > 0  # some slot was sampled in two stages: the product is exercised
        assert layer.filled <= BOUND


def test_a_compression_keeps_the_sinks_and_the_recent_window_and_the_oracle_every_token():
    """The sinks and the last n_recent positions survive every compression; the oracle's prefix plus the appended
    slots is every token in position order; the certified steps carry finite certificates and true errors."""
    _, model, _ = build("llama")
    state = kvcert.prefill(model, _tiny_ids())
    decoding, _ = _decode(model, state, "poisson", 60)
    for layer, oracle in zip(decoding.cache.layers, decoding.context.oracle.layers):
        for g in range(layer.keys.shape[1]):
            positions = set(layer.positions[0, g][torch.isfinite(layer.log_pi[0, g])].tolist())
            assert set(range(OPTIONS.n_sink)) <= positions
            assert set(range(layer.length - OPTIONS.n_recent, layer.length)) <= positions
        appended = layer.positions[0, 0, layer.n_prefix_slots: layer.filled]
        assert torch.equal(torch.cat([oracle.positions[0, 0], appended]), torch.arange(layer.length))
    assert state.cache.layers[0].filled == state.context_tokens  # the prefill's cache is untouched
    steps = decoding.results()[0].steps
    assert steps["cert"].notna().all() and steps["true_err"].notna().all() and (steps["cert"] > 0).any()


def test_topk_stays_deterministic_under_the_bound():
    """Top-k re-compressions keep π = 1 everywhere (no offset, no certificate) and the same bound."""
    _, model, _ = build("llama")
    state = kvcert.prefill(model, _tiny_ids())
    decoding, _ = _decode(model, state, "topk", 60, oracle=False)
    result = decoding.results()[0]
    for layer in decoding.cache.layers:
        finite = torch.isfinite(layer.log_pi)
        assert (layer.log_pi[finite] == 0).all() and layer.n_sampled_slots == 0
    assert result.peak_cache_tokens == BOUND and result.decode_compressions >= 6


def test_two_stage_weights_are_unbiased_and_so_is_the_variance():
    """The statistics behind the compound offset, by simulation: stage one Poisson-samples 120 slots, a compression
    (``thin_head``, its probabilities depending on the stage-one sample) thins the kept ones to an expected 40; the
    Horvitz-Thompson total with the compound π is unbiased for the population total, and the survey variance
    estimator Σ (1 − π)/π² y² with the compound π for its variance (within simulation error)."""
    g = torch.Generator().manual_seed(0)
    n, d = 120, 8
    keys = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    y = torch.rand(n, generator=g, dtype=torch.float64) * 2 + 0.5
    policy = get_policy("knorm")
    pi1 = inclusion_probabilities(torch.rand(1, n, generator=g), 70, n_sink=4, n_recent=8)[0].double()
    draws, totals, variances = 400, [], []
    for _ in range(draws):
        kept1 = poisson_sample(pi1, g)
        idx = kept1.nonzero()[:, 0]
        view = LayerView(keys=keys[:, :, idx].float(), values=keys[:, :, idx].float(),
                         window_queries=torch.zeros(1, 1, 1, d), accumulated_attention=None, scale=1.0)
        local, stage = thin_head(view, torch.log(pi1[idx]).float(), 40, policy=policy, design="poisson",
                                 options=DesignOptions(n_sink=4, n_recent=8), generator=g)
        kept = idx[local]
        pi = compound_log_pi(torch.log(pi1[kept]), stage).double().exp()
        totals.append(float((y[kept] / pi).sum()))
        variances.append(float(((1 - pi) / pi ** 2 * y[kept] ** 2).sum()))
    totals_t = torch.tensor(totals, dtype=torch.float64)
    se = float(totals_t.std()) / math.sqrt(draws)
    assert abs(float(totals_t.mean()) - float(y.sum())) < 4 * se
    assert float(torch.tensor(variances).mean()) == pytest.approx(float(totals_t.var()), rel=0.2)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_cache_tokens": 52, "compression_interval": 16},
     "max_cache_tokens=52 is at or below the certain slots plus the interval: n_sink=4 + n_recent=32 + "
     "compression_interval=16 = 52"),
    ({"max_cache_tokens": 36, "compression_interval": 1}, "max_cache_tokens=36 is at or below"),
    ({"compression_interval": 8}, "compression_interval=8 needs max_cache_tokens"),
    ({"max_cache_tokens": 128, "compression_interval": 0}, "compression_interval=0 must be an integer >= 1"),
    ({"max_cache_tokens": 128, "policy": "h2o"}, "policy='h2o': it scores with what only a prefill collects"),
])
def test_a_bound_without_room_is_refused_in_one_line_and_the_model_is_untouched(kwargs, message):
    _, model, _ = build("llama")
    before = model.config._attn_implementation
    options = {"policy": "snapkv", "compression_ratio": 0.5, **kwargs}
    with pytest.raises(ValueError) as err:
        press = kvcert.press(**options)
        with press(model):
            pass
    assert message in str(err.value) and "\n" not in str(err.value)
    assert model.config._attn_implementation == before and not model._forward_pre_hooks


def _passkey(tokenizer, new_tokens):
    context, question, key = passkey_prompt(n_noise=8, n_needles=1, seed=2)
    ids = kvcert.build_prompt(tokenizer, context, question, " The pass key is", max_new_tokens=new_tokens).prefix_ids
    return context, question, ids


@pytest.mark.smollm2
def test_on_smollm2_stock_generate_stays_under_the_bound_and_is_kvcert_generates(smollm2):
    """Stock greedy ``model.generate`` under a bounded press: after every forward pass no layer holds more than
    max_cache_tokens slots (read from the cache generate holds, not from the press's own count), the cache was
    compressed again several times, and tokens and step table (certificates, oracle errors) are those of
    ``kvcert.generate`` with the same bound."""
    model, tokenizer = smollm2
    new_tokens, bound, interval = 32, 96, 16
    context, question, ids = _passkey(tokenizer, new_tokens)
    assert ids.shape[-1] + new_tokens > 2 * bound
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.5, seed=3, oracle=True,
                         max_cache_tokens=bound, compression_interval=interval)
    after_pass = []

    def slots(module, args, kwargs, output):
        cache, ids = output.past_key_values, kwargs.get("input_ids", args[0] if args else None)
        if isinstance(cache, kvcert.presses.PressCache) and ids.shape[-1] == 1:  # a decode pass
            after_pass.append(max(max(layer.filled, layer._buffers[0].shape[2]) for layer in cache.layers))

    with press(model):
        handle = model.register_forward_hook(slots, with_kwargs=True)
        try:
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        finally:
            handle.remove()
    assert model.config._attn_implementation == "sdpa"
    assert len(after_pass) == new_tokens - 1 and max(after_pass) <= bound
    cert = press.certificate
    assert cert.peak_cache_tokens <= bound and cert.decode_compressions >= 2 * model.config.num_hidden_layers
    assert cert.steps["true_err"].notna().all() and cert.max_rel_cert > 0
    result = kvcert.generate(model, tokenizer, context=context, question=question, answer_prefix=" The pass key is",
                             policy="snapkv", design="poisson", budget=0.5, seed=3, oracle=True,
                             max_new_tokens=new_tokens, max_cache_tokens=bound, compression_interval=interval)
    assert result.peak_cache_tokens == cert.peak_cache_tokens
    generated = out[0, ids.shape[-1]:].tolist()
    stop = next((i + 1 for i, t in enumerate(generated) if t in eos_ids(model, tokenizer)), len(generated))
    assert generated[:stop] == result.token_ids
    pd.testing.assert_frame_equal(cert.steps[cert.steps["step"] < stop - 1].reset_index(drop=True), result.steps)


@pytest.mark.smollm2
def test_on_smollm2_generate_refuses_a_bound_without_room_before_the_prefill(smollm2):
    model, tokenizer = smollm2
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"^kvcert.generate: max_cache_tokens=44 is at or below the certain "
                                             r"slots plus the interval: n_sink=4 \+ n_recent=32 \+ "
                                             r"compression_interval=8 = 44"):
            kvcert.generate(model, tokenizer, context="a b c", question="d?", policy="snapkv", budget=0.5,
                            max_cache_tokens=44, compression_interval=8)
        with pytest.raises(ValueError, match="policy='full'"):
            kvcert.generate(model, tokenizer, context="a b c", question="d?", policy="full", max_cache_tokens=128)
    finally:
        handle.remove()
    assert calls == []


def test_the_seed_of_the_compressions_is_the_configurations_own():
    """The compressions draw from a stream of their own, derived from the configuration's (item) seed."""
    _, model, _ = build("llama")
    state = kvcert.prefill(model, _tiny_ids())
    bound = check_decode_bound(BOUND, INTERVAL, policy="snapkv", design="poisson", options=OPTIONS)
    runs = []
    for seed in (7, 7, 8):
        out, = decode_configurations(model, state, [Configuration("snapkv", "poisson", 0.5, seed)], item_id="x",
                                     max_new_tokens=24, stop_ids=set(), decode_bound=bound)
        runs.append(out.steps["trace_var"].to_numpy())
    assert (runs[0] == runs[1]).all() and not (len(runs[0]) == len(runs[2]) and (runs[0] == runs[2]).all())
    assert item_seed(7, "x") != 7


def test_heads_of_different_counts_are_thinned_each_to_the_bound():
    """Top-k under a per-head allocator (AdaKV: heads keep different counts at the prefill): a head already under
    the compression's target keeps its slots, the others are cut to it, and no head or layer exceeds the bound."""
    _, model, _ = build("llama")
    state = kvcert.prefill(model, _tiny_ids())
    bound = check_decode_bound(BOUND, INTERVAL, policy="snapkv", design="topk", options=OPTIONS)
    out, = decode_configurations(model, state, [Configuration("snapkv", "topk", 0.35, 0)], max_new_tokens=24,
                                 stop_ids=set(), decode_bound=bound, allocator="adakv")
    counts = kvcert.select(state, "snapkv", "topk", 0.35, 0, allocator="adakv")[0].retained
    # the allocator's counts differ by the interval or more: at the first compression the short head is at the target
    assert int(counts.max()) - int(counts.min()) >= INTERVAL
    assert out.peak_cache_tokens <= BOUND and out.decode_compressions >= 2


@pytest.mark.smollm2
def test_on_smollm2_several_questions_stay_under_the_bound(smollm2):
    """``press.answer`` (one prefill of the document, each question fed at once on its compressed cache): the
    question's tokens and the answer fit under the bound, each answer's certificate says how."""
    model, tokenizer = smollm2
    context, question, _ = passkey_prompt(n_noise=8, n_needles=1, seed=2)
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.5, seed=1, max_cache_tokens=96)
    answers = press.answer(model, tokenizer, context=context, questions=[question, "\nWhat is the noise about?"],
                           max_new_tokens=12)
    for answer in answers:
        assert answer.certificate.peak_cache_tokens <= 96 and answer.certificate.decode_compressions > 0
        assert answer.certificate.max_rel_cert > 0

"""Generation on tiny random-weight models built from configs (no download).

At budget 1.0 the ``topk`` design keeps every slot and the ``poisson`` design has π = 1 everywhere, so the
kvcert attention path must reproduce the stock ``sdpa`` attention with a standard ``DynamicCache``: same
logits (≤ 1e-5) over a prefill and several greedy decode steps, in both settings, for Llama, Mistral and
Qwen2 (sliding window), Gemma3 (sliding / full layers), a single-KV-head (MQA) Llama, Phi-3 (fused qkv) and
StableLM (partial rotary, q/k/v biases); the models are ``tests/helpers/tiny_models.py``'s.
"""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from helpers.tiny_models import ARCHS
from helpers.tiny_models import build as _build
from helpers.tiny_models import prompt as _prompt
from transformers import DynamicCache

import kvcert
from kvcert.attention import CONTEXT_KWARG
from kvcert.certificates import CertificateRecorder
from kvcert.context import AttentionContext
from kvcert.kernels import attention_path
from kvcert.policies import prefill_needs
from kvcert.generation import decode_batch
from kvcert.sampling import retained_count

CONTEXT = 40
QUESTION = 6
STEPS = 4
ATOL = 1e-5
FIELD_SCORERS = ["expected_attention", "criticalkv", "observed_attention", "leverage", "cap"]  # kvpress's, beyond the originals


def _prefill(model, context: torch.Tensor, question: torch.Tensor, setting: str, **needs):
    """Question-aware: prefill context + question together; streaming: the question becomes the suffix.
    needs: what the prefill collects besides (``kvcert.policies.prefill_needs``)."""
    if setting == "question_aware":
        return kvcert.prefill(model, torch.cat([context, question], -1), setting=setting, **needs)
    return kvcert.prefill(model, context, question, setting=setting, **needs)


@torch.no_grad()
def _stock_greedy(model, ids: torch.Tensor, steps: int):
    """Logits (steps + 1, vocab) after the prompt and after each greedy token, and the greedy tokens."""
    cache = DynamicCache(config=model.config)
    logits = [model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]]
    tokens = []
    for _ in range(steps):
        token = int(logits[-1].argmax())
        tokens.append(token)
        logits.append(model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(logits), tokens


@torch.no_grad()
def _kvcert_logits(model, state, selections, tokens, *, certify: bool, oracle: bool):
    """Logits of the kvcert path on a derived cache, teacher-forced with ``tokens``; and the pass's context."""
    cache = state.cache.derive(selections)
    recorder = None
    if certify or oracle:
        recorder = CertificateRecorder(cache.layers[0].length, oracle=oracle,
                                       path=attention_path(cache.layers[0].keys.dtype, "cpu"))
    ctx = AttentionContext(cache, recorder=recorder, oracle=state.cache if oracle else None)
    kwargs = {"cache": cache, "use_cache": True, CONTEXT_KWARG: ctx}
    with kvcert.attach(model, ctx):
        if state.suffix_ids.shape[-1] > 0:
            logits = [model(input_ids=state.suffix_ids, **kwargs).logits[0, -1]]
        else:
            logits = [state.last_logits[0]]
        for token in tokens:
            logits.append(model(input_ids=torch.tensor([[token]]), **kwargs).logits[0, -1])
    return torch.stack(logits).float(), ctx


@pytest.mark.parametrize("arch", ARCHS)
def test_budget_one_reproduces_stock_attention(arch):
    reference, model, sliding = _build(arch)
    context, question = _prompt(1)
    ref_logits, ref_tokens = _stock_greedy(reference, torch.cat([context, question], -1), STEPS)

    for setting in ("question_aware", "streaming"):
        state = _prefill(model, context, question, setting)
        if setting == "question_aware":
            assert torch.allclose(state.last_logits[0], ref_logits[0], atol=ATOL, rtol=0)
        for design in ("topk", "poisson"):
            selections = kvcert.select(state, "snapkv", design, 1.0, seed=3)
            for sel in selections:  # every slot kept, all certain
                assert sel.index.shape[-1] == state.context_tokens
                assert bool((sel.log_pi == 0).all())
            for certify, oracle in ((False, False), (True, True)):
                logits, cache = _kvcert_logits(model, state, selections, ref_tokens, certify=certify, oracle=oracle)
                diff = float((logits - ref_logits).abs().max())
                assert diff <= ATOL, f"{arch} {setting} {design} certify={certify}: max |Δlogit| = {diff:.2e}"
                if certify:
                    assert cache.recorder.records, "a certifying decode records every compressed attention call"
                    for rec in cache.recorder.records:
                        assert bool((rec.trace_var == 0).all())  # no tail: zero variance
                        assert float(rec.true_err.max()) < 1e-4
            decoded = kvcert.decode(model, state, selections, max_new_tokens=STEPS, certify=True, oracle=True)
            assert decoded.token_ids == ref_tokens
            ref_lp = torch.log_softmax(ref_logits[:STEPS], -1)[torch.arange(STEPS), ref_tokens]
            assert np.allclose(decoded.logprobs, ref_lp.numpy(), atol=ATOL)
            assert decoded.cache_bytes == decoded.full_bytes
            assert len(decoded.steps) > 0 and bool((decoded.steps["trace_var"] == 0).all())


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
def test_sliding_window_is_exercised(arch):
    """Without the window the stock logits move: the budget-1.0 comparison above does test the window."""
    reference, _, _ = _build(arch)
    cfg = copy.deepcopy(reference.config)
    cfg.sliding_window = 10_000
    unwindowed = type(reference)(cfg).eval()
    unwindowed.load_state_dict(reference.state_dict())
    context, question = _prompt(1)
    ids = torch.cat([context, question], -1)
    a, _ = _stock_greedy(reference, ids, 1)
    b, _ = _stock_greedy(unwindowed, ids, 1)
    assert float((a - b).abs().max()) > 1e-4


def test_full_policy_uses_the_uncompressed_cache():
    reference, model, _ = _build("llama")
    context, question = _prompt(2)
    ref_logits, ref_tokens = _stock_greedy(reference, torch.cat([context, question], -1), STEPS)
    state = kvcert.prefill(model, context, question, setting="streaming")
    decoded = kvcert.decode(model, state, None, max_new_tokens=STEPS, oracle=True)
    assert decoded.token_ids == ref_tokens
    assert len(decoded.steps) == 0  # no compressed attention, no certificate rows
    assert decoded.cache_bytes == decoded.full_bytes


@pytest.mark.parametrize("arch", ["llama_mqa", "gemma3"])
@pytest.mark.parametrize("design", ["topk", "poisson"])
def test_model_generate_runs_on_the_compressed_cache(arch, design):
    """``model.generate(cache=...)`` on a compressed cache gives kvcert.decode's greedy tokens."""
    _, model, _ = _build(arch)
    context, question = _prompt(4, n_context=160)
    state = kvcert.prefill(model, context, question, setting="streaming")
    selections = kvcert.select(state, "snapkv", design, 0.25, seed=5)
    decoded = kvcert.decode(model, state, selections, max_new_tokens=6, certify=False)
    cache = state.cache.derive(selections)
    with torch.no_grad(), kvcert.attach(model, cache):  # generate drops kvcert's keyword: the cache is bound
        out = model.generate(
            input_ids=torch.cat([context, question], -1),
            attention_mask=torch.ones((1, context.shape[-1] + question.shape[-1]), dtype=torch.long),
            cache=cache,
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    generated = out[0, context.shape[-1] + question.shape[-1] :].tolist()
    assert generated == decoded.token_ids
    # The cache generate ran on is the compressed one: its prefix slots stayed compressed.
    n = state.context_tokens
    layer = cache.layers[0]
    assert layer.length == n + question.shape[-1] + 5
    assert layer.keys.shape[-2] - (layer.length - n) < n
    # the binding lived for the block only
    from transformers import AttentionInterface
    assert model.config._attn_implementation == "sdpa"
    assert not [name for name in AttentionInterface._global_mapping if name.startswith("kvcert_")]


@pytest.mark.parametrize("policy", ["snapkv", *FIELD_SCORERS])
@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
@pytest.mark.parametrize("design", ["topk", "poisson"])
def test_compressed_budget_runs_with_physical_slots_near_budget(setting, design, policy):
    _, model, _ = _build("gemma3")
    context, question = _prompt(6, n_context=320)
    state = _prefill(model, context, question, setting, **prefill_needs([policy]))
    n = state.context_tokens
    budget = 0.25
    expected = retained_count(budget, n)
    assert expected == round(budget * n)  # long enough prompt: the sinks+recent floor is not binding
    selections = kvcert.select(state, policy, design, budget, seed=7)
    decoded = kvcert.decode(model, state, selections, max_new_tokens=5, certify=True, oracle=True)
    assert np.isfinite(decoded.logprobs).all()
    steps = decoded.steps
    assert len(steps) > 0
    for column in ("trace_var", "true_err", "rel_err"):
        assert np.isfinite(steps[column]).all(), column
    if design == "poisson":
        assert np.isfinite(steps["cert"]).all() and (steps["trace_var"] > 0).any()
    else:
        assert steps["cert"].isna().all()  # a deterministic design has no certificate
    slots = [sel.retained.float() for sel in selections]  # (1, kv_heads) per layer
    if design == "topk":
        assert all(bool((s == expected).all()) for s in slots)
        assert decoded.retained_tokens == expected
    else:
        # Poisson: expected count = budget per KV head; the realized count is within a few SDs of it.
        assert abs(decoded.retained_tokens - expected) <= 0.15 * expected
        assert max(sel.index.shape[-1] for sel in selections) <= 1.3 * expected
    assert decoded.cache_bytes / decoded.full_bytes <= budget + 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_field_scorers_score_every_architecture(arch):
    """ExpectedAttention, CriticalKV, ObservedAttention, LeverageScore and Cap on every tiny architecture (GQA, MQA,
    sliding windows, Gemma 3's two RoPEs, Phi-3's fused qkv, StableLM's partial rotary): one non-negative finite
    score per cached token and KV head, and they rank the tokens differently from each other."""
    _, model, _ = _build(arch)
    context, question = _prompt(5)
    state = _prefill(model, context, question, "question_aware", **prefill_needs(FIELD_SCORERS))
    scores = {name: state.scores(name) for name in FIELD_SCORERS}
    for name, layers in scores.items():
        for layer_scores, layer in zip(layers, state.cache.layers):
            assert layer_scores.shape == layer.keys.shape[:-1], name
            assert torch.isfinite(layer_scores).all() and (layer_scores >= 0).all(), name
    first = [s[0].flatten() for s in scores.values()]
    assert not torch.equal(first[0].argsort(), first[2].argsort())


@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
def test_serving_trace_equals_oracle_trace_and_batch_rows_are_independent(setting):
    """Serving (trace-only moments) and oracle (per-coordinate moments) compute tr V̂ by different sums; they
    must agree. A configuration decoded in a batch with deterministic and full rows gets the same tokens and
    certificates as decoded alone (the rows share one pass per layer and one variance computation)."""
    _, model, _ = _build("gemma3")
    context, question = _prompt(8, n_context=320)
    state = _prefill(model, context, question, setting)
    poisson = kvcert.select(state, "snapkv", "poisson", 0.25, seed=3)
    topk = kvcert.select(state, "snapkv", "topk", 0.5, seed=3)
    serving = kvcert.decode(model, state, poisson, max_new_tokens=6, certify=True, oracle=False)
    oracle = kvcert.decode(model, state, poisson, max_new_tokens=6, certify=True, oracle=True)
    assert serving.token_ids == oracle.token_ids
    assert (serving.steps["trace_var"] > 0).any() and serving.steps["true_err"].isna().all()
    keys = ["step", "layer", "kv_head"]
    pd.testing.assert_frame_equal(serving.steps[keys], oracle.steps[keys])
    np.testing.assert_allclose(serving.steps["trace_var"], oracle.steps["trace_var"], rtol=1e-4, atol=1e-10)

    rows = decode_batch(model, state, [topk, poisson, None], max_new_tokens=6, certify=True, oracle=True)
    assert rows[1].token_ids == oracle.token_ids
    pd.testing.assert_frame_equal(rows[1].steps[keys], oracle.steps[keys])
    # true_err is ~1e-8 where a layer's window holds only certain slots: there float32 rounding is the error
    for column, atol in (("trace_var", 1e-10), ("true_err", 1e-6), ("rel_err", 1e-5)):
        np.testing.assert_allclose(rows[1].steps[column], oracle.steps[column], rtol=1e-4, atol=atol)
    assert bool((rows[0].steps["trace_var"] == 0).all()) and rows[0].steps["cert"].isna().all()
    assert rows[2].steps.empty


def test_interleaved_decodings_match_decode():
    """Advancing two Decodings pass by pass in turn (as the overhead benchmark does) changes nothing: each
    gives the tokens, log-probabilities and step statistics that ``decode`` gives alone."""
    _, model, _ = _build("llama")
    context, question = _prompt(4, n_context=120)
    state = _prefill(model, context, question, "streaming")
    poisson = kvcert.select(state, "snapkv", "poisson", 0.3, seed=1)
    alone = {
        "plain": kvcert.decode(model, state, poisson, max_new_tokens=5, certify=False),
        "oracle": kvcert.decode(model, state, poisson, max_new_tokens=5, certify=True, oracle=True),
    }
    decodings = {
        "plain": kvcert.Decoding(model, state, [poisson], max_new_tokens=5, certify=False),
        "oracle": kvcert.Decoding(model, state, [poisson], max_new_tokens=5, certify=True, oracle=True),
    }
    running = list(decodings)
    passes = 0
    while running:
        running = [name for name in running if decodings[name].advance()]
        passes += 1
    assert passes == 5  # four passes after the suffix's, then the last token is picked without one
    for name, decoding in decodings.items():
        (result,) = decoding.results()
        assert result.token_ids == alone[name].token_ids and len(result.token_ids) == 5
        np.testing.assert_allclose(result.logprobs, alone[name].logprobs, rtol=0, atol=1e-6)
        pd.testing.assert_frame_equal(result.steps, alone[name].steps)
    assert decodings["oracle"].results()[0].steps["true_err"].notna().all()


@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
def test_recorded_trace_matches_hajek_attention_on_the_captured_queries(setting):
    """Every recorded tr V̂ against ``hajek_attention`` (float64) on the same queries and retained slots.

    The attention call computes the variance from its own softmax weights of the sampled slots, centred on
    the rows' mean output; here each call's queries and slots are captured and the variance is recomputed from
    scratch, one query position at a time, with the causal and sliding-window masks folded into log π. Gemma3 has a sliding and a full layer; the streaming setting also has a multi-token pass.
    """
    from helpers.attention import call_context, interposed

    from kvcert.attention import kvcert_attention

    _, model, _ = _build("gemma3")
    captured = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        ctx = call_context(kwargs)
        layer = ctx.cache.layers[module.layer_idx] if ctx is not None else None
        if layer is not None and layer.compressed:
            captured.append((module.layer_idx, query.detach().double(), layer.keys.double(), layer.values.double(),
                             layer.log_pi.double(), layer.positions.clone(), kwargs.get("scaling"),
                             kwargs.get("sliding_window")))
        return kvcert_attention(module, query, key, value, attention_mask, **kwargs)

    context, question = _prompt(11, n_context=200)
    state = _prefill(model, context, question, setting)
    poisson = kvcert.select(state, "snapkv", "poisson", 0.3, seed=2)
    with interposed(capture):  # decode attaches "kvcert": the wrapper records every call
        decoded = kvcert.decode(model, state, poisson, max_new_tokens=5, certify=True)
    steps = decoded.steps.set_index(["step", "layer", "kv_head"])["trace_var"]
    prefix = state.prefix_ids.shape[-1]
    checked, windowed = 0, 0
    for layer_idx, q, k, v, log_pi, positions, scale, sliding in captured:
        b, hq, m, d = q.shape
        hk = k.shape[1]
        for j in range(m):
            q_pos = int(positions[0, 0, -m + j])
            step = q_pos - prefix
            if (step, layer_idx, 0) not in steps.index:
                continue  # the last generated token's pass is not recorded (its output is never used)
            visible = positions <= q_pos
            if sliding is not None:
                visible &= positions > q_pos - sliding
                windowed += int((~visible & torch.isfinite(log_pi) & (log_pi < 0)).any())
            masked = torch.where(visible, log_pi, torch.full_like(log_pi, float("-inf")))
            grouped = q[:, :, j].reshape(b, hk, hq // hk, d)
            _, var = kvcert.hajek_attention(grouped, k, v, masked, scale=scale)
            reference = var.sum(dim=(-2, -1))[0]  # (kv_heads,)
            for h in range(hk):
                np.testing.assert_allclose(steps.loc[(step, layer_idx, h)], float(reference[h]), rtol=2e-4, atol=1e-9)
                checked += 1
    n_steps = len(decoded.token_ids) - 1 + (question.shape[-1] if setting == "streaming" else 0)
    assert checked == len(steps) == n_steps * 2 * 2  # every recorded (step, layer, kv_head) was checked
    assert windowed > 0  # the sliding window did hide sampled slots from some query
    assert float(steps.max()) > 0


# Policies that score from the cached keys and values alone; LagKV's lag is shortened so that a 160-token prompt has
# partitions to rank, CUR's block so that several blocks fit.
KEY_VALUE_SCORERS = {"keydiff": {}, "lagkv": {"lag_size": 16}, "cur": {"local_window_size": 8}}


@pytest.mark.parametrize("policy", sorted(KEY_VALUE_SCORERS))
@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
def test_key_value_scorers_compress_in_both_designs(policy, setting):
    """On the tiny Gemma3 (4 query heads over 2 KV heads; layer 0 with an 8-token sliding window): top-k keeps every
    certain slot and, past them, scores no lower than any it drops; Poisson samples a tail and certifies; both
    decode."""
    _, model, _ = _build("gemma3")
    context, question = _prompt(12, n_context=160)
    prefix, suffix = (torch.cat([context, question], -1), None) if setting == "question_aware" else (context, question)
    options = {policy: KEY_VALUE_SCORERS[policy]}
    state = kvcert.prefill(model, prefix, suffix, setting=setting, policy_options=options)
    n = state.context_tokens
    expected = retained_count(0.3, n)
    certain = torch.zeros(n, dtype=torch.bool)
    certain[:4] = certain[n - 32:] = True  # the default sinks and recent window
    for design in ("topk", "poisson"):
        selections = kvcert.select(state, policy, design, 0.3, seed=4)
        decoded = kvcert.decode(model, state, selections, max_new_tokens=3, certify=True)
        assert np.isfinite(decoded.logprobs).all() and len(decoded.token_ids) == 3
        if design == "topk":
            for scores, sel in zip(state.scores(policy), selections):
                assert bool((sel.retained == expected).all())
                for h in range(scores.shape[1]):
                    kept = torch.zeros(n, dtype=torch.bool)
                    kept[sel.index[0, h]] = True
                    assert bool(kept[certain].all())
                    assert float(scores[0, h][kept & ~certain].min()) >= float(scores[0, h][~kept].max())
        else:
            assert any(sel.has_tail for sel in selections)
            assert np.isfinite(decoded.steps["cert"]).all() and (decoded.steps["trace_var"] > 0).any()
    # the scores are per KV head: the two heads of a layer rank the tokens differently
    assert any(bool((scores[0, 0] != scores[0, 1]).any()) for scores in state.scores(policy))

"""Compressed decoding below budget 1.0 against references that share no code with kvcert's attention.

Two references, through the decode path (``kvcert.decode``), in both settings, with the certificate off and
on (the two must pick the same tokens), for every tiny architecture of ``tests/helpers/tiny_models.py`` and
for the bundled SmolLM2 (marked ``smollm2``):

* **Retained sets shared by every layer and KV head** (StreamingLLM under the ``topk`` design; a hand-built
  set with sampled slots and their log π): the stock ``transformers`` model (``sdpa``, ``DynamicCache``) run
  on the whole prompt, with a 4-D additive attention mask that hides the evicted prefix positions and adds
  the Hájek offset −log π to the sampled ones, its own causal and sliding-window masks written into it, and
  every token at its original position. Greedy tokens must be the same and log-probabilities within 1e-4.
* **Retained sets per KV head** (SnapKV under both designs): every attention call's queries are captured,
  and each layer's output, the true error and tr V̂ of every (step, layer, KV head) are recomputed in
  float64 from the uncompressed prefix keys and values of the prefill (taken at the positions the
  selection names, with their log π) and the appended tokens' keys and values, one query at a time.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers.attention import call_context, interposed
from helpers.tiny_models import ARCHS, build, prompt
from transformers import DynamicCache

import kvcert
from kvcert.attention import kvcert_attention
from kvcert.designs import Selection

STEPS = 4
LOGPROB_ATOL = 1e-4
SETTINGS = ("question_aware", "streaming")


# --------------------------------------------------------------------------- the stock reference


def _sliding_layers(config) -> tuple[dict[str, bool] | None, bool]:
    """How the stock model takes a 4-D mask: a dict keyed by layer type, or one mask (sliding or not)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" in layer_types:
        return {"full_attention": False, "sliding_attention": True}, True
    return None, getattr(config, "sliding_window", None) is not None


def _mask(q_pos: torch.Tensor, key_bias: torch.Tensor, window: int | None) -> torch.Tensor:
    """(1, 1, m, L) additive mask: key_bias (L,) where the key at position k is visible from q, −inf elsewhere."""
    k_pos = torch.arange(key_bias.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    return torch.where(visible, key_bias[None, :], torch.tensor(float("-inf")))[None, None].float()


@torch.no_grad()
def stock_masked_decode(reference, prefix: torch.Tensor, suffix: torch.Tensor, prefix_bias: torch.Tensor, steps: int):
    """Greedy decode of the stock model with the prefix's keys masked/offset by ``prefix_bias``.

    prefix (1, n), suffix (1, s) ids; prefix_bias (n,): 0 certain, −log π sampled, −inf evicted. The prefix is
    prefilled with plain causal attention (it is uncompressed there in kvcert too); the suffix (streaming
    setting) and every generated token then attend through the mask. Returns (tokens, log-probabilities).
    """
    config = reference.config.get_text_config(decoder=True)
    by_type, single_sliding = _sliding_layers(config)
    window = getattr(config, "sliding_window", None)
    cache = DynamicCache()  # no config: sliding-window layers keep every key too, the masks do the windowing
    n = prefix.shape[-1]
    logits = reference(input_ids=prefix, cache=cache, use_cache=True).logits[0, -1]

    def step(ids: torch.Tensor, first: int):
        q_pos = torch.arange(first, first + ids.shape[-1])
        key_bias = torch.cat([prefix_bias, torch.zeros(first + ids.shape[-1] - n)])
        if by_type is not None:
            mask = {t: _mask(q_pos, key_bias, window if sliding else None) for t, sliding in by_type.items()}
        else:
            mask = _mask(q_pos, key_bias, window if single_sliding else None)
        out = reference(input_ids=ids, attention_mask=mask, position_ids=q_pos[None], cache=cache, use_cache=True)
        return out.logits[0, -1]

    position = n
    if suffix.shape[-1] > 0:
        logits = step(suffix, position)
        position += suffix.shape[-1]
    tokens, logprobs = [], []
    for i in range(steps):
        lp = torch.log_softmax(logits.double(), -1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        if i + 1 < steps:
            logits = step(torch.tensor([[token]]), position)
            position += 1
    return tokens, logprobs


def _prefill(model, context, question, setting):
    if setting == "question_aware":
        return kvcert.prefill(model, torch.cat([context, question], -1), setting=setting)
    return kvcert.prefill(model, context, question, setting=setting)


def shared_prefix_bias(selections: list[Selection], n: int) -> torch.Tensor:
    """(n,) 0 / −log π / −inf of a selection that every layer and KV head shares (asserted)."""
    first = selections[0]
    for sel in selections:
        for h in range(sel.index.shape[1]):
            assert torch.equal(sel.index[0, h], first.index[0, 0]) and torch.equal(sel.log_pi[0, h], first.log_pi[0, 0])
    bias = torch.full((n,), float("-inf"))
    valid = torch.isfinite(first.log_pi[0, 0])
    bias[first.index[0, 0][valid]] = -first.log_pi[0, 0][valid]
    return bias


def hand_built_selection(n: int, n_layers: int, kv_heads: int, seed: int) -> list[Selection]:
    """One retained set for every layer and KV head: 4 sinks and the last 8 certain, the rest kept with a
    seeded π in [0.15, 0.9] and carrying log π (a Hájek offset the stock mask must reproduce)."""
    g = torch.Generator().manual_seed(seed)
    pi = 0.15 + 0.75 * torch.rand(n, generator=g)
    pi[:4] = 1.0
    pi[-8:] = 1.0
    keep = torch.rand(n, generator=g) < pi
    index = torch.nonzero(keep).flatten()
    log_pi = torch.log(pi[index]).float()
    assert bool((log_pi < 0).any())
    sel = Selection(index=index.expand(1, kv_heads, -1).clone(), log_pi=log_pi.expand(1, kv_heads, -1).clone())
    return [sel] * n_layers


def streaming_positions(n: int, budget: float) -> list[int]:
    """StreamingLLM's retained positions, from its definition: 4 attention sinks and the latest tokens."""
    count = max(4 + 32, round(budget * n))
    return list(range(4)) + list(range(n - (count - 4), n))


def _check_shared(reference, model, context, question, setting, selections, label):
    state = _prefill(model, context, question, setting)
    bias = shared_prefix_bias(selections, state.context_tokens)
    ref_tokens, ref_lp = stock_masked_decode(reference, state.prefix_ids, state.suffix_ids, bias, STEPS)
    runs = {}
    for certify, oracle in ((False, False), (True, True)):
        decoded = kvcert.decode(model, state, selections, max_new_tokens=STEPS, certify=certify, oracle=oracle)
        runs[(certify, oracle)] = decoded
        assert decoded.token_ids == ref_tokens, f"{label} certify={certify} oracle={oracle}"
        diff = float(np.max(np.abs(np.asarray(decoded.logprobs) - ref_lp)))
        assert diff <= LOGPROB_ATOL, f"{label} certify={certify}: max |Δ log p| = {diff:.2e}"
    return state, runs


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_retained_sets_match_the_stock_model_with_a_mask(arch, setting):
    # A 48-token window: evicted, sampled and certain slots all lie inside it for some query and outside for others.
    reference, model, _ = build(arch, seed=1, window=48)
    context, question = prompt(31, n_context=120, n_question=6)
    n = context.shape[-1] + (question.shape[-1] if setting == "question_aware" else 0)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    kv_heads = model.config.get_text_config(decoder=True).num_key_value_heads
    for budget in (0.25, 0.5):
        state = _prefill(model, context, question, setting)
        selections = kvcert.select(state, "streamingllm", "topk", budget)
        assert selections[0].index[0, 0].tolist() == streaming_positions(n, budget)
        _check_shared(reference, model, context, question, setting, selections, f"{arch} streaming {budget}")
    selections = hand_built_selection(n, n_layers, kv_heads, seed=5)
    _, runs = _check_shared(reference, model, context, question, setting, selections, f"{arch} hand-built")
    steps = runs[(True, True)].steps
    assert (steps["trace_var"] > 0).any() and steps["true_err"].notna().all()


def test_the_mask_matters():
    """Evicting changes the stock model's tokens or log-probabilities: the comparison above is not vacuous."""
    reference, _, _ = build("llama", seed=1)
    context, question = prompt(31, n_context=120, n_question=6)
    prefix = torch.cat([context, question], -1)
    n = prefix.shape[-1]
    full = stock_masked_decode(reference, prefix, prefix[:, :0], torch.zeros(n), STEPS)
    bias = torch.full((n,), float("-inf"))
    bias[streaming_positions(n, 0.25)] = 0.0
    evicted = stock_masked_decode(reference, prefix, prefix[:, :0], bias, STEPS)
    assert full[0] != evicted[0] or np.abs(np.subtract(full[1], evicted[1])).max() > 1e-2


# --------------------------------------------------------------------------- the float64 recomputation


def _capture(calls: list):
    """A wrapper of kvcert's attention that appends every call on a compressed layer to ``calls``."""

    def capture(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out, _ = kvcert_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        ctx = call_context(kwargs)
        layer = ctx.cache.layers[module.layer_idx] if ctx is not None else None
        if layer is not None and layer.compressed:
            calls.append({"layer": module.layer_idx, "query": query.detach().double()[0].clone(),
                          "keys": layer.keys[0].double().clone(), "values": layer.values[0].double().clone(),
                          "positions": layer.positions[0].clone(), "out": out.detach().double()[0].clone(),
                          "scale": float(scaling), "sliding": kwargs.get("sliding_window")})
        return out, None

    return capture


def _attend(q, keys, values, log_pi, positions, q_pos, scale, sliding):
    """Hájek attention of one query in float64 numpy, written from the formulas.

    q (d,); keys (s, d); values (s, dv); log_pi (s,): 0 certain, log π sampled, −inf not retained;
    positions (s,). Returns the output (dv,) and the per-coordinate linearized variance (dv,).
    """
    visible = (positions <= q_pos) & np.isfinite(log_pi)
    if sliding is not None:
        visible &= positions > q_pos - sliding
    logits = scale * (keys[visible] @ q) - log_pi[visible]
    a = np.exp(logits - logits.max())
    a /= a.sum()
    out = a @ values[visible]
    one_minus_pi = 1.0 - np.exp(log_pi[visible])
    var = (one_minus_pi[:, None] * a[:, None] ** 2 * (values[visible] - out) ** 2).sum(0)
    return out, var


def recompute(state, selections, calls):
    """Per captured call and query: the float64 Hájek output per query head, and per (step, layer, kv_head)
    the true error and tr V̂, from the prefill's full prefix keys/values and the appended tokens."""
    n = state.context_tokens
    outputs, rows = [], {}
    for call in calls:
        layer = state.cache.layers[call["layer"]]
        prefix_keys, prefix_values = layer.keys[0].double().numpy(), layer.values[0].double().numpy()
        sel = selections[call["layer"]]
        hq, m, _ = call["query"].shape
        hk = prefix_keys.shape[0]
        group = hq // hk
        out = np.zeros((m, hq, call["values"].shape[-1]))
        for g in range(hk):
            appended = (call["positions"][g] >= n).numpy()
            keys = np.concatenate([prefix_keys[g], call["keys"][g].numpy()[appended]])
            values = np.concatenate([prefix_values[g], call["values"][g].numpy()[appended]])
            positions = np.concatenate([np.arange(n), call["positions"][g].numpy()[appended]])
            log_pi = np.full(n, -np.inf)
            valid = torch.isfinite(sel.log_pi[0, g])
            log_pi[sel.index[0, g][valid].numpy()] = sel.log_pi[0, g][valid].double().numpy()
            log_pi = np.concatenate([log_pi, np.zeros(int(appended.sum()))])
            q_positions = call["positions"][g].numpy()[-m:]
            for j in range(m):
                est, true, trace = [], [], 0.0
                for r in range(group):
                    q = call["query"][g * group + r, j].numpy()
                    o_hat, var = _attend(q, keys, values, log_pi, positions, q_positions[j], call["scale"],
                                         call["sliding"])
                    o, _ = _attend(q, keys, values, np.zeros_like(log_pi), positions, q_positions[j], call["scale"],
                                   call["sliding"])
                    out[j, g * group + r] = o_hat
                    est.append(o_hat)
                    true.append(o)
                    trace += float(var.sum())
                err = float(np.linalg.norm(np.concatenate(est) - np.concatenate(true)))
                rows[(int(q_positions[j]) - n, call["layer"], g)] = (err, trace)
        outputs.append(out)
    return outputs, rows


def _check_per_head(model, state, selections, label, out_atol=2e-5):
    """Decode with the certificate off and on (oracle): same tokens, every layer's output and every step's
    true error and tr V̂ equal to the float64 recomputation."""
    tokens = None
    for certify in (False, True):
        calls = []
        with interposed(_capture(calls)):
            decoded = kvcert.decode(model, state, selections, max_new_tokens=STEPS, certify=certify, oracle=certify)
        assert tokens is None or decoded.token_ids == tokens, label
        tokens = decoded.token_ids
        outputs, rows = recompute(state, selections, calls)
        for call, expected in zip(calls, outputs):
            got = call["out"].numpy()
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=out_atol,
                                       err_msg=f"{label} certify={certify} layer {call['layer']}")
        if certify:
            steps = decoded.steps.set_index(["step", "layer", "kv_head"])
            assert len(steps) > 0 and set(steps.index) <= set(rows)
            for key, row in steps.iterrows():
                err, trace = rows[key]
                np.testing.assert_allclose(row["true_err"], err, rtol=1e-3, atol=1e-6, err_msg=f"{label} {key}")
                np.testing.assert_allclose(row["trace_var"], trace, rtol=1e-3, atol=1e-9, err_msg=f"{label} {key}")
    return decoded


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_per_head_retained_sets_match_a_float64_recomputation(arch, setting):
    # A window of 64 over a 200-token prompt: it hides sampled slots from every query, and shows it others.
    _, model, sliding = build(arch, seed=2, window=64)
    context, question = prompt(41, n_context=200, n_question=6)
    state = _prefill(model, context, question, setting)
    for design in ("poisson", "topk"):
        selections = kvcert.select(state, "snapkv", design, 0.3, seed=4)
        if model.config.get_text_config(decoder=True).num_key_value_heads > 1:  # the sets do differ per head
            assert any(not torch.equal(s.index[0, 0], s.index[0, 1]) for s in selections)
        decoded = _check_per_head(model, state, selections, f"{arch} {setting} {design}")
        if design == "poisson":
            assert (decoded.steps["trace_var"] > 0).any()


# --------------------------------------------------------------------------- the bundled model


@pytest.fixture(scope="module")
def smollm2(smollm2):
    model, tokenizer = smollm2  # the session's (tests/conftest.py)
    reference = copy.deepcopy(model)  # stock attention: kvcert attaches its own only inside its calls
    return model, reference, tokenizer


def _smollm2_prompt(tokenizer, setting):
    from kvcert.theory import passkey_prompt

    context, question, _ = passkey_prompt(n_noise=4, n_needles=1, seed=2)  # about 120 tokens
    prompt = kvcert.build_prompt(tokenizer, context, question, setting=setting)
    return prompt.prefix_ids, prompt.suffix_ids


@pytest.mark.smollm2
@pytest.mark.parametrize("setting", SETTINGS)
def test_smollm2_streaming_llm_matches_the_masked_stock_model(smollm2, setting):
    model, reference, tokenizer = smollm2
    prefix, suffix = _smollm2_prompt(tokenizer, setting)
    state = kvcert.prefill(model, prefix, suffix, setting=setting)
    n = state.context_tokens
    for budget in (0.25, 0.5):
        selections = kvcert.select(state, "streamingllm", "topk", budget)
        assert selections[0].index[0, 0].tolist() == streaming_positions(n, budget)
        bias = shared_prefix_bias(selections, n)
        ref_tokens, ref_lp = stock_masked_decode(reference, prefix, suffix, bias, STEPS)
        for certify in (False, True):
            decoded = kvcert.decode(model, state, selections, max_new_tokens=STEPS, certify=certify, oracle=certify)
            assert decoded.token_ids == ref_tokens
            assert np.abs(np.asarray(decoded.logprobs) - ref_lp).max() <= LOGPROB_ATOL


@pytest.mark.smollm2
def test_smollm2_snapkv_poisson_matches_a_float64_recomputation(smollm2):
    model, _, tokenizer = smollm2
    prefix, suffix = _smollm2_prompt(tokenizer, "streaming")
    state = kvcert.prefill(model, prefix, suffix, setting="streaming")
    selections = kvcert.select(state, "snapkv", "poisson", 0.5, seed=3)
    decoded = _check_per_head(model, state, selections, "smollm2 streaming poisson", out_atol=1e-4)
    assert (decoded.steps["trace_var"] > 0).any()


# --------------------------------------------------------------------------- budget allocators


def _budget_bytes(model, counts: list[int]) -> int:
    """Bytes of ``counts[layer]`` retained slots per layer summed over KV heads (counts are per layer, all heads
    together), from the model's config: a slot of one head holds its key and value (model dtype), log π and the
    offset (float32) and its position (int64)."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return sum(counts) * (2 * head_dim * element + 4 + 4 + 8)


@pytest.mark.parametrize("arch", ARCHS)
def test_allocated_retained_sets_match_a_float64_recomputation_and_keep_their_budget(arch):
    """AdaKV and PyramidKV, both designs: the decoded output is full attention over the kept (ragged per head)
    set in float64, and the kept bytes are the allocation's: exactly the uniform total for top-k, the sampled
    slots for Poisson (whose expected count is that total)."""
    _, model, _ = build(arch, seed=2, window=64)
    context, question = prompt(41, n_context=200, n_question=6)
    state = _prefill(model, context, question, "question_aware")
    config = model.config.get_text_config(decoder=True)
    layers, kv_heads, n = config.num_hidden_layers, config.num_key_value_heads, state.context_tokens
    count = kvcert.retained_count(0.3, n)
    uniform_bytes = _budget_bytes(model, [kv_heads * count] * layers)
    # beta 1.5: at this short prompt the default (20) would leave the last layer fewer than its certain slots,
    # and the pyramid falls back to the uniform allocation
    for allocator, options in (("adakv", {"alpha_safeguard": 0.2}), ("pyramidkv", {"beta": 1.5})):
        for design in ("topk", "poisson"):
            selections = kvcert.select(state, "snapkv", design, 0.3, seed=4, allocator=allocator,
                                       allocator_options=options)
            kept = [int(s.retained.sum()) for s in selections]
            label = f"{arch} {allocator} {design}"
            decoded = _check_per_head(model, state, selections, label)
            assert decoded.kept_bytes == _budget_bytes(model, kept), label
            assert decoded.kept_bytes <= decoded.cache_bytes, label  # the padded buffers hold at least the kept
            if design == "topk":
                assert decoded.kept_bytes == uniform_bytes, label
                per_head = torch.stack([s.retained[0] for s in selections])  # (layers, kv_heads)
                if allocator == "pyramidkv":
                    assert (per_head[0] > per_head[-1]).all(), label  # the first layer keeps more than the last
                elif kv_heads > 1:
                    assert bool((per_head != count).any()), label  # the heads' counts differ
            else:  # Σπ over the pool is the uniform total (tests/test_allocators.py); one draw lies near it
                assert 0.5 * uniform_bytes < decoded.kept_bytes < 1.5 * uniform_bytes, label
                assert (decoded.steps["trace_var"] > 0).any(), label

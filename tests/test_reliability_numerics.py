"""Issue #6: certificates stay finite and >= 0 in low precision and at the edges of the design.

* ``kvcert.hajek_attention`` with float32 / bfloat16 / float16 inputs: π at its floor (down to 1e-12), a
  tail with a single retained token, a row whose only retained slot is sampled, all-certain rows (variance
  exactly 0), large logits, π just below 1.
* A tiny random-weight Llama converted to bfloat16 and float16, through ``kvcert.prefill`` / ``select`` /
  ``decode`` with design=poisson and the oracle on: every step's trace_var, cert and true_err are finite
  and >= 0, with default options, a floor-bound tail, a tail-only design at a tiny budget, and budget 1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvcert
from kvcert.designs import DesignOptions

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NEG_INF = float("-inf")


def _qkv(dtype, n=12, m=3, d=16, heads=2, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, m, d, generator=g) * scale).to(dtype)
    k = (torch.randn(1, heads, n, d, generator=g) * scale).to(dtype)
    v = torch.randn(1, heads, n, d, generator=g).to(dtype)
    return q, k, v


def _check(out, var, dtype):
    assert out.dtype in (torch.float32, torch.float64) and var.dtype == out.dtype, "computed in float32"
    assert torch.isfinite(out).all() and torch.isfinite(var).all()
    assert (var >= 0).all()
    trace = var.sum(-1)
    cert = kvcert.certificate(trace, 0.05)
    assert torch.isfinite(cert).all() and (cert >= 0).all()
    return trace


def _trace_reference(q, k, v, log_pi) -> np.ndarray:
    """The variance's trace Σ_i (1 − π_i) a_i² ‖v_i − ô‖² in float64 from the same (rounded) inputs, (1, heads, m):
    a the softmax weights of the logits q·k/√d − log π over the retained slots, ô = Σ a_i v_i."""
    q, k, v, log_pi = (t.double().numpy() for t in (q, k, v, log_pi))
    keep = np.isfinite(log_pi)  # (1, heads, n)
    logits = np.einsum("bhmd,bhnd->bhmn", q, k) / math.sqrt(q.shape[-1]) - np.where(keep, log_pi, 0.0)[..., None, :]
    logits = np.where(keep[..., None, :], logits, -np.inf)
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    out = np.einsum("bhmn,bhnd->bhmd", a, v)
    spread = ((v[:, :, None] - out[..., None, :]) ** 2).sum(-1)  # (1, heads, m, n)
    return ((-np.expm1(np.where(keep, log_pi, 0.0)))[..., None, :] * a**2 * spread).sum(-1)


def _log_pi(n, heads=2, certain=(), tail=None):
    """(1, heads, n): 0 at ``certain``, log π at ``tail`` {index: π}, -inf elsewhere."""
    log_pi = torch.full((1, heads, n), NEG_INF)
    for i in certain:
        log_pi[..., i] = 0.0
    for i, p in (tail or {}).items():
        log_pi[..., i] = math.log(p)
    return log_pi


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pi_floor", [1e-3, 1e-6, 1e-12])
def test_pi_at_its_floor(dtype, pi_floor):
    q, k, v = _qkv(dtype)
    log_pi = _log_pi(12, certain=range(4), tail={i: pi_floor for i in range(4, 12)})
    out, var = kvcert.hajek_attention(q, k, v, log_pi)
    trace = _check(out, var, dtype)
    # Floor tokens carry huge weight 1/π: a large but finite variance, the formula's to float32 rounding.
    np.testing.assert_allclose(trace.double().numpy(), _trace_reference(q, k, v, log_pi), rtol=2e-3)
    assert (trace > 0.01).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_retained_tail_token(dtype):
    q, k, v = _qkv(dtype)
    log_pi = _log_pi(12, certain=(0, 1, 11), tail={5: 0.3})
    out, var = kvcert.hajek_attention(q, k, v, log_pi)
    trace = _check(out, var, dtype)
    # One sampled slot: the trace is (1 − 0.3) a_5² ‖v_5 − ô‖², to float32 rounding.
    np.testing.assert_allclose(trace.double().numpy(), _trace_reference(q, k, v, log_pi), rtol=2e-3)
    assert (trace > 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pi", [1e-3, 0.5])
def test_only_retained_slot_is_sampled(dtype, pi):
    """A row whose single retained slot is a tail token: ô = v_i exactly, so the variance is 0."""
    q, k, v = _qkv(dtype)
    out, var = kvcert.hajek_attention(q, k, v, _log_pi(12, tail={7: pi}))
    trace = _check(out, var, dtype)
    assert torch.allclose(trace, torch.zeros_like(trace), atol=1e-6)
    assert torch.allclose(out, v[..., 7:8, :].float().expand_as(out), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_certain_rows_have_zero_variance(dtype):
    q, k, v = _qkv(dtype)
    out, var = kvcert.hajek_attention(q, k, v, torch.zeros(1, 2, 12))
    _check(out, var, dtype)
    assert (var == 0).all()
    # Equal to plain attention.
    ref = torch.softmax(q.float() @ k.float().transpose(-1, -2) / 4.0, dim=-1) @ v.float()
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_logits_and_pi_near_one(dtype):
    """Logits in the hundreds (fp16 would overflow exp) and π = 1 − 1e-7 stay finite in the float32 path."""
    q, k, v = _qkv(dtype, scale=6.0)
    log_pi = _log_pi(12, certain=(0,), tail={**{i: 1e-3 for i in range(1, 6)}, **{i: 1 - 1e-7 for i in range(6, 12)}})
    out, var = kvcert.hajek_attention(q, k, v, log_pi)
    _check(out, var, dtype)


# --- a tiny model in low precision, through prefill / select / decode ------------------------------------

VOCAB = 300
CONTEXT = 64


@pytest.fixture(scope="module")
def tiny_models():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    base = LlamaForCausalLM(cfg).eval()
    models = {}
    for dtype in (torch.bfloat16, torch.float16):
        model = LlamaForCausalLM(cfg).eval()
        model.load_state_dict(base.state_dict())
        models[dtype] = model.to(dtype)
    return models


OPTIONS = {
    "default": (0.25, DesignOptions(n_sink=4, n_recent=8)),
    "floor-bound-tail": (0.5, DesignOptions(n_sink=1, n_recent=1, head_fraction=0.0, pi_min=0.4)),
    "tail-only-tiny-budget": (0.05, DesignOptions(n_sink=0, n_recent=1, head_fraction=0.0, pi_min=1e-3)),
    "all-certain": (1.0, DesignOptions(n_sink=4, n_recent=8)),
}


@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_model_certificates_are_finite(tiny_models, dtype, option, setting):
    model = tiny_models[dtype]
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, VOCAB, (1, CONTEXT), generator=g)
    question = torch.randint(0, VOCAB, (1, 6), generator=g)
    prefix, suffix = (torch.cat([context, question], -1), None) if setting == "question_aware" else (context, question)
    state = kvcert.prefill(model, prefix, suffix, setting=setting, observation_window=4)
    budget, options = OPTIONS[option]
    tail_counts, at_floor = [], False
    for seed in (0, 1):
        selections = kvcert.select(state, "snapkv", "poisson", budget, seed, options)
        for sel in selections:
            sampled = (sel.log_pi < 0) & torch.isfinite(sel.log_pi)
            tail_counts += sampled.sum(-1).flatten().tolist()
            at_floor |= bool((sampled & ((sel.log_pi - math.log(options.pi_min)).abs() < 1e-4)).any())
        decoded = kvcert.decode(model, state, selections, max_new_tokens=3, certify=True, oracle=True, randomized=True)
        steps = decoded.steps
        assert len(steps) > 0
        for column in ("trace_var", "cert", "true_err"):
            values = steps[column].to_numpy(dtype=float)
            assert np.isfinite(values).all(), (column, values)
            assert (values >= 0).all(), (column, values.min())
        assert np.isfinite(decoded.logprobs).all()
        if option == "all-certain":
            assert (steps["trace_var"] == 0).all() and (steps["cert"] == 0).all()
    # The edge cases are really exercised: retained tokens at the floor; heads with a single sampled token.
    if option == "floor-bound-tail":
        assert at_floor
    if option == "tail-only-tiny-budget":
        # round(0.05 · 64) = 3 retained, 1 of them the recent token: 2 tail tokens expected per head, and more
        # than 8 has a chance below 3e-4 (Poisson tail of mean 2)
        assert min(tail_counts) <= 1 and max(tail_counts) <= 8, tail_counts
    if option == "all-certain":
        assert max(tail_counts) == 0


@pytest.mark.parametrize("policy", ["leverage", "cur"])
def test_a_drawing_policys_scores_do_not_depend_on_the_global_generator(tiny_models, policy):
    """Scores of a policy that draws a sketch (leverage by default, cur with sketch_dimension) are the same for the
    same prompt whatever consumed torch's global generator before: two prefills, the global generator advanced in
    between. (Reading the global generator made a cell's leverage rows depend on what its process ran first.)"""
    model = tiny_models[torch.bfloat16]
    context = torch.randint(0, VOCAB, (1, CONTEXT), generator=torch.Generator().manual_seed(2))
    options = {"cur": {"sketch_dimension": 8}}
    first = kvcert.prefill(model, context, pre_rope_keys=True, policy_options=options).scores(policy)
    torch.randn(1000)  # what a model load or an earlier item may draw
    second = kvcert.prefill(model, context, pre_rope_keys=True, policy_options=options).scores(policy)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], first[1])  # the layers' own scores (and sketches), not one copy

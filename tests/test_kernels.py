"""The compiled ``hajek_step`` kernel against the float64 estimator, and generation with and without it.

The kernel is compiled on first use with the machine's C++ compiler; a machine that cannot build it fails
here (with ``KVCERT_KERNELS=0`` these tests are skipped and the PyTorch path is used everywhere).
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch

import kvcert
from kvcert import kernels
from kvcert.estimator import offset_bias, one_minus_pi
from kvcert.generation import decode_batch

if os.environ.get(kernels.DISABLE_ENV) == "0":
    pytest.skip(f"{kernels.DISABLE_ENV}=0: the compiled kernel is disabled", allow_module_level=True)


@pytest.fixture(scope="module")
def op():
    op = kernels.hajek_step_op()
    assert op is not None, "the hajek_step kernel did not compile (see the RuntimeWarning above)"
    return op


def _inputs(seed, *, b=2, h=3, r=3, d=64, n=700, t=300, value_offset=0.0, q_scale=1.0):
    """Random q, keys/values as views into larger buffers (as the cache holds them), log π with a sampled
    prefix of t slots, some of them not retained (−inf) in one row."""
    g = torch.Generator().manual_seed(seed)
    capacity = n + 64
    q = torch.randn(b, h, r, d, generator=g) * q_scale
    k = torch.randn(b, h, capacity, d, generator=g)[:, :, :n]
    v = (torch.randn(b, h, capacity, d, generator=g) + value_offset)[:, :, :n]
    log_pi = torch.zeros(b, h, n)
    log_pi[..., :t] = torch.rand(b, h, t, generator=g).clamp_min(0.05).log()
    if t >= 10:
        log_pi[0, min(1, h - 1), t - 10 : t] = float("-inf")
    return q, k, v, log_pi


def _reference(q, k, v, log_pi, scale):
    """hajek_attention in float64, each query row with its own log π (shared here)."""
    return kvcert.hajek_attention(q.double(), k.double(), v.double(), log_pi.double(), scale)


def _run(op, q, k, v, log_pi, scale, bias=None):
    """The kernel with the cache's arguments: 1 − π of the slots up to the last sampled one."""
    sampled = ((log_pi < 0) & torch.isfinite(log_pi)).flatten(0, -2).any(0)
    t = int(torch.nonzero(sampled).max()) + 1 if bool(sampled.any()) else 0
    bias = offset_bias(log_pi).unsqueeze(-2) if bias is None else bias
    return op(q, k, v, bias, one_minus_pi(log_pi[..., :t]).contiguous(), scale)


def _max_rel(x, ref):
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize(
    "shape",
    [
        dict(n=700, t=300),  # several chunks per KV head
        dict(n=40, t=20, d=16, r=2),  # one short chunk
        dict(n=1300, t=1300, b=1, h=1, r=1),  # every slot sampled, one head: chunks must still merge
        dict(n=200, t=0),  # nothing sampled: zero variance
        dict(n=512, t=100, d=48, r=6),  # head size that is not a multiple of the vector width
        dict(n=300, t=120, d=128, r=5),  # head size 128: row tiles of 2, 2 and 1
    ],
)
def test_kernel_matches_float64_estimator(op, shape):
    q, k, v, log_pi = _inputs(0, **shape)
    out, var = _run(op, q, k, v, log_pi, 0.125)
    ref_out, ref_var = _reference(q, k, v, log_pi, 0.125)
    assert out.dtype == var.dtype == torch.float32 and out.shape == var.shape == ref_out.shape
    assert _max_rel(out, ref_out) < 1e-5
    if shape["t"] == 0:
        assert bool((var == 0).all())
    else:
        assert _max_rel(var, ref_var) < 1e-5
        # per coordinate, not just in the largest entries
        np.testing.assert_allclose(var.double(), ref_var, rtol=1e-3, atol=1e-6 * float(ref_var.max()))


def _reference_terms(q, k, v, log_pi, scale):
    """(Σc, Σc²), c = (1 − π) a² over the sampled slots, in float64 from the softmax weights."""
    weights = torch.softmax(scale * q.double() @ k.double().transpose(-1, -2)
                            + offset_bias(log_pi.double()).unsqueeze(-2), dim=-1)
    c = one_minus_pi(log_pi.double()).unsqueeze(-2) * weights**2
    c = torch.where(torch.isfinite(log_pi) & (log_pi < 0), 1.0, 0.0).double().unsqueeze(-2) * c
    return torch.stack([c.sum(-1), c.square().sum(-1)], dim=-1)


@pytest.mark.parametrize(
    "shape",
    [dict(n=700, t=300), dict(n=40, t=20, d=16, r=2), dict(n=300, t=120, d=128, r=5), dict(n=512, t=100, d=48, r=6),
     dict(n=200, t=0)],
)
def test_kernel_terms_match_float64(op, shape):
    """The optional ``terms`` output: per query row, Σ(1 − π)a² and Σ((1 − π)a²)² over the sampled slots
    (the effective number of terms behind V̂ follows from them), overwriting whatever the buffer held, and
    leaving out and var exactly as without it."""
    q, k, v, log_pi = _inputs(7, **shape)
    terms = torch.full((*q.shape[:-1], 2), 123.0)
    sampled = ((log_pi < 0) & torch.isfinite(log_pi)).flatten(0, -2).any(0)
    t = int(torch.nonzero(sampled).max()) + 1 if bool(sampled.any()) else 0
    args = (q, k, v, offset_bias(log_pi).unsqueeze(-2), one_minus_pi(log_pi[..., :t]).contiguous(), 0.125)
    out, var = op(*args, terms)
    plain_out, plain_var = op(*args)
    assert torch.equal(out, plain_out) and torch.equal(var, plain_var)
    ref = _reference_terms(q, k, v, log_pi, 0.125)
    if shape["t"] == 0:
        assert bool((terms == 0).all())
    else:
        np.testing.assert_allclose(terms.double(), ref, rtol=1e-4, atol=1e-12)
        assert bool((terms[..., 0] > 0).all())


def test_kernel_terms_buffer_is_checked(op):
    q, k, v, log_pi = _inputs(4, n=50, t=10)
    args = (q, k, v, offset_bias(log_pi).unsqueeze(-2), one_minus_pi(log_pi[..., :10]).contiguous(), 0.1)
    with pytest.raises(RuntimeError, match="terms must be a contiguous"):
        op(*args, torch.zeros((*q.shape[:-1], 3)))
    with pytest.raises(RuntimeError, match="terms must be float32"):
        op(*args, torch.zeros((*q.shape[:-1], 2), dtype=torch.float64))


@pytest.mark.parametrize("value_offset,q_scale", [(300.0, 1.0), (0.0, 4.0), (300.0, 4.0)])
def test_kernel_is_as_accurate_as_the_float32_estimator(op, value_offset, q_scale):
    """Values sharing a large offset and peaked attention: the kernel's error against float64 stays within a
    small factor of the PyTorch float32 path's own error (both are float32 computations)."""
    q, k, v, log_pi = _inputs(1, value_offset=value_offset, q_scale=q_scale)
    out, var = _run(op, q, k, v, log_pi, 0.125)
    ref_out, ref_var = _reference(q, k, v, log_pi, 0.125)
    f32_out, f32_var = kvcert.hajek_attention(q, k, v, log_pi, 0.125)
    assert _max_rel(out, ref_out) <= max(4 * _max_rel(f32_out, ref_out), 1e-6)
    assert _max_rel(var, ref_var) <= max(4 * _max_rel(f32_var, ref_var), 1e-6)
    assert _max_rel(var, ref_var) < 1e-3


def test_kernel_applies_a_per_row_mask(op):
    """A bias with one row per query (causal / sliding-window masks) hides slots from some rows only."""
    q, k, v, log_pi = _inputs(2, n=300, t=150, r=4)
    b, h, r, n = *q.shape[:3], k.shape[2]
    visible = torch.ones(b, h, r, n, dtype=torch.bool)
    visible[:, :, 1, 50:140] = False  # some sampled slots hidden from row 1
    visible[:, :, 3, 200:] = False  # certain slots hidden from row 3
    masked = torch.where(visible, log_pi.unsqueeze(2), torch.tensor(float("-inf")))
    out, var = _run(op, q, k, v, log_pi, 0.1, bias=offset_bias(masked))
    for row in range(r):
        ref_out, ref_var = _reference(q[:, :, row : row + 1], k, v, masked[:, :, row], 0.1)
        assert _max_rel(out[:, :, row : row + 1], ref_out) < 1e-5
        assert _max_rel(var[:, :, row : row + 1], ref_var) < 1e-5


def test_kernel_negligible_weights_give_zero_not_subnormal_variance(op):
    """Sampled slots whose weight is far below float32 resolution (logits lowered by 200 against the rest):
    their (1 − π) a² terms are dropped, so the variance is 0 where the float64 value is below 1e-38."""
    q, k, v, log_pi = _inputs(3, n=200, t=100, b=1, h=1, r=1)
    bias = offset_bias(log_pi).unsqueeze(-2).clone()
    bias[..., :100] -= 200.0
    out, var = _run(op, q, k, v, log_pi, 0.125, bias=bias)
    # float64 by hand: weights from the lowered logits, variance over the 100 sampled slots
    weights = torch.softmax(0.125 * q.double() @ k.double().transpose(-1, -2) + bias.double(), dim=-1)
    ref_out = weights @ v.double()
    c = (1 - log_pi.double().exp())[..., :100].unsqueeze(-2) * weights[..., :100] ** 2
    tail = v.double()[..., :100, :]
    ref_var = c @ tail**2 - 2 * ref_out * (c @ tail) + ref_out**2 * c.sum(-1, keepdim=True)
    assert _max_rel(out, ref_out) < 1e-5
    assert float(ref_var.abs().max()) < 1e-38 and bool((var == 0).all())


def test_kernel_results_do_not_depend_on_the_thread_count(op):
    """Chunks have a fixed size, so 1 and 2 threads sum in the same order: bit-identical results."""
    q, k, v, log_pi = _inputs(5, n=1100, t=500)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(op, q, k, v, log_pi, 0.125)
        torch.set_num_threads(2)
        two = _run(op, q, k, v, log_pi, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_kernel_rejects_bad_inputs_with_the_argument_named(op):
    q, k, v, log_pi = _inputs(4, n=50, t=10)
    bias, w = offset_bias(log_pi).unsqueeze(-2), one_minus_pi(log_pi[..., :10]).contiguous()
    with pytest.raises(RuntimeError, match="k must be float32"):
        op(q, k.double(), v, bias, w, 0.1)
    with pytest.raises(RuntimeError, match="v .* does not match k"):
        op(q, k, v[:, :, :40], bias, w, 0.1)
    with pytest.raises(RuntimeError, match="bias .* is not"):
        op(q, k, v, bias[..., :40], w, 0.1)
    with pytest.raises(RuntimeError, match="one_minus_pi .* does not match"):
        op(q, k, v, bias, w[:1], 0.1)


def test_disabling_the_kernel_returns_none(monkeypatch):
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    assert kernels.hajek_step_op() is None
    path = kernels.attention_path(torch.float32, "cpu")
    assert (path.name, path.reason, path.op) == ("pytorch", "disabled by KVCERT_KERNELS=0", None)
    monkeypatch.delenv(kernels.DISABLE_ENV)
    assert kernels.hajek_step_op() is not None


@pytest.mark.parametrize("dtype, device, reason", [
    (torch.bfloat16, "cpu", "dtype bfloat16: the compiled kernel is float32-only"),
    (torch.float16, "cpu", "dtype float16: the compiled kernel is float32-only"),
    (torch.float32, "cuda", "device cuda: the compiled kernel is CPU-only"),
    (torch.float32, "meta", "device meta: the compiled kernel is CPU-only"),
])
def test_the_kernel_is_never_loaded_or_built_where_it_does_not_apply(dtype, device, reason, monkeypatch):
    """GPU and non-float32 runs take the PyTorch path without touching the kernel (no build inside such jobs)."""
    def refuse():
        raise AssertionError("the kernel was loaded or built for a run it does not apply to")

    monkeypatch.setattr(kernels, "_load", refuse)
    path = kernels.attention_path(dtype, device)
    assert (path.name, path.reason, path.op) == ("pytorch", reason, None)
    assert path.as_dict() == {"path": "pytorch", "reason": reason}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
def test_generation_with_and_without_the_kernel_agree(arch, setting, monkeypatch, op):
    """Whole decodes with the compiled kernel and with the PyTorch path: same tokens, step statistics equal
    to float32 rounding (certificate, true error and Wald coverage included), on a Llama and on Gemma3's
    sliding and full layers."""
    from test_generation_tiny import _build, _prefill, _prompt

    _, model, _ = _build(arch)
    context, question = _prompt(5, n_context=260)
    state = _prefill(model, context, question, setting)
    poisson = kvcert.select(state, "snapkv", "poisson", 0.3, seed=4)
    topk = kvcert.select(state, "snapkv", "topk", 0.3, seed=4)
    options = dict(max_new_tokens=6, certify=True, oracle=True)
    fused = decode_batch(model, state, [poisson, topk], **options)
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    plain = decode_batch(model, state, [poisson, topk], **options)
    assert fused[0].attention_path == {"path": "kernel", "reason": ""}
    assert plain[0].attention_path == {"path": "pytorch", "reason": "disabled by KVCERT_KERNELS=0"}
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        keys = ["step", "layer", "kv_head"]
        pd.testing.assert_frame_equal(a.steps[keys], b.steps[keys])
        # true_err is ~1e-8 where a layer's window holds only certain slots: there it is float32 rounding
        for column, atol in (("trace_var", 1e-9), ("cert", 1e-6), ("true_err", 1e-6)):
            np.testing.assert_allclose(a.steps[column], b.steps[column], rtol=1e-4, atol=atol)
        # the effective number of terms where the variance is more than rounding
        weighty = (b.steps["trace_var"] > 1e-6).to_numpy()
        np.testing.assert_allclose(a.steps["tail_ess"][weighty], b.steps["tail_ess"][weighty], rtol=1e-3)
        # Wald coverage where the error is more than rounding (a coordinate on an interval's edge may flip)
        real = (b.steps["true_err"] > 1e-5).to_numpy()
        assert real.any()
        np.testing.assert_allclose(a.steps["wald_coverage"][real], b.steps["wald_coverage"][real], rtol=0, atol=0.05)
    assert (fused[0].steps["trace_var"] > 0).any()


@pytest.mark.parametrize("oracle", [False, True])
def test_a_pass_mixing_kernel_and_pytorch_layers_records_the_same(oracle, op, monkeypatch):
    """Layers on different devices or dtypes (e.g. a model split by device_map) can mix the kernel and the
    PyTorch path within one pass; the pass's records must equal those of either path alone. Here layer 0
    runs the kernel and layer 1 the PyTorch path (trace-only moments when serving, per coordinate with
    the oracle)."""
    from helpers.attention import interposed
    from test_generation_tiny import _build, _prefill, _prompt

    from helpers.attention import call_context

    from kvcert.attention import kvcert_attention
    from kvcert.certificates import CertificateRecorder

    def mixed(module, query, key, value, attention_mask, **kwargs):
        ctx = call_context(kwargs)
        if ctx is not None and ctx.recorder is not None:
            ctx.recorder.kernel = op if module.layer_idx == 0 else None
        return kvcert_attention(module, query, key, value, attention_mask, **kwargs)

    _, model, _ = _build("llama")
    context, question = _prompt(6, n_context=200)
    state = _prefill(model, context, question, "streaming")
    poisson = kvcert.select(state, "snapkv", "poisson", 0.3, seed=5)
    reference = kvcert.decode(model, state, poisson, max_new_tokens=5, certify=True, oracle=oracle)

    handed = []
    add = CertificateRecorder.add

    def spy(self, layer, length, shape, out, *rest):  # the kernel hands (b, kv_heads, rows, dv), PyTorch (b·kv_heads, …)
        handed.append((length, layer, out.ndim))
        return add(self, layer, length, shape, out, *rest)

    monkeypatch.setattr(CertificateRecorder, "add", spy)
    with interposed(mixed):
        result = kvcert.decode(model, state, poisson, max_new_tokens=5, certify=True, oracle=oracle)
    passes = {}
    for length, layer, ndim in handed:
        passes.setdefault(length, {})[layer] = ndim
    assert passes and all(p == {0: 4, 1: 3} for p in passes.values())  # every pass really mixed both paths
    assert result.token_ids == reference.token_ids
    keys = ["step", "layer", "kv_head"]
    pd.testing.assert_frame_equal(result.steps[keys], reference.steps[keys])
    assert set(result.steps["layer"]) == {0, 1} and (result.steps["trace_var"] > 0).all()
    np.testing.assert_allclose(result.steps["trace_var"], reference.steps["trace_var"], rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(result.steps["tail_ess"], reference.steps["tail_ess"], rtol=1e-3)

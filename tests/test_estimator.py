"""``hajek_attention`` and ``certificate`` against an independent float64 reference (docs/METHOD.md).

The reference below is written from the formulas, one attention row at a time:
    w_i = exp(q·k_i · scale), S = retained slots (finite log π), π_i = exp(log π_i),
    ô = Σ_S (w_i/π_i) v_i / Σ_S (w_i/π_i),   a_i = (w_i/π_i) / Σ_S (w_j/π_j),
    V̂_j = Σ_{S∩tail} (1 − π_i) a_i² (v_ij − ô_j)²    (certain tokens have π = 1 and add nothing).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcert import EmptyRetainedSetError, certificate, hajek_attention
from kvcert.estimator import hajek_with_variance, offset_bias, one_minus_pi


def reference(q, k, v, log_pi, scale=None):
    """Row-by-row float64 numpy reference. q (..., m, d), k (..., n, d), v (..., n, dv), log_pi (..., n)."""
    q, k, v, log_pi = (np.asarray(t.double().numpy(), dtype=np.float64) for t in (q, k, v, log_pi))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch = q.shape[:-2]
    m, dv = q.shape[-2], v.shape[-1]
    out = np.zeros(batch + (m, dv))
    var = np.zeros(batch + (m, dv))
    for idx in np.ndindex(*batch):
        for row in range(m):
            retained = [i for i in range(k.shape[-2]) if np.isfinite(log_pi[idx][i])]
            logits = np.array([float(np.dot(q[idx][row], k[idx][i])) * scale for i in retained])
            pis = np.array([math.exp(log_pi[idx][i]) for i in retained])
            w = np.exp(logits - logits.max()) / pis
            a = w / w.sum()
            o = sum(a[j] * v[idx][i] for j, i in enumerate(retained))
            vj = np.zeros(dv)
            for j, i in enumerate(retained):
                vj += (1.0 - pis[j]) * a[j] ** 2 * (v[idx][i] - o) ** 2
            out[idx + (row,)] = o
            var[idx + (row,)] = vj
    return out, var


def random_case(batch=(2, 3), m=3, n=17, d=8, dv=5, seed=0, dtype=torch.float64):
    """Random q, k, v and a log π mixing certain (0), sampled (log π < 0) and padding (−inf) slots."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, m, d, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(*batch, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(*batch, n, dv, generator=g, dtype=torch.float64)
    pi = torch.rand(*batch, n, generator=g, dtype=torch.float64) * 0.95 + 0.05
    kind = torch.randint(0, 4, (*batch, n), generator=g)
    log_pi = torch.where(kind == 0, torch.zeros_like(pi), torch.log(pi))  # ~1/4 certain
    log_pi = torch.where(kind == 1, torch.full_like(pi, float("-inf")), log_pi)  # ~1/4 padding
    log_pi[..., 0] = 0.0  # at least one retained slot per row
    return q.to(dtype), k.to(dtype), v.to(dtype), log_pi.to(dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("batch", "m"), [((2, 3), 3), ((4,), 1), ((1, 2, 2), 5)])
def test_matches_reference_float64(seed, batch, m):
    q, k, v, log_pi = random_case(batch=batch, m=m, seed=seed)
    out, var = hajek_attention(q, k, v, log_pi)
    ref_out, ref_var = reference(q, k, v, log_pi)
    assert out.dtype == torch.float64 and var.dtype == torch.float64
    assert out.shape == (*batch, m, 5) and var.shape == (*batch, m, 5)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=1e-10)
    np.testing.assert_allclose(var.numpy(), ref_var, rtol=1e-8, atol=1e-12)
    assert (ref_var > 0).any()  # the case does exercise the tail term


def test_matches_reference_float32_and_custom_scale():
    q, k, v, log_pi = random_case(seed=5, dtype=torch.float32)
    out, var = hajek_attention(q, k, v, log_pi, scale=0.3)
    ref_out, ref_var = reference(q, k, v, log_pi, scale=0.3)
    assert out.dtype == torch.float32 and var.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=2e-6)
    np.testing.assert_allclose(var.numpy(), ref_var, rtol=1e-4, atol=1e-7)


def test_large_value_offset_does_not_cancel():
    """Values with a large common offset: the variance is offset-invariant, the float32 result must be too."""
    q, k, v, log_pi = random_case(seed=6)
    _, ref_var = reference(q, k, v, log_pi)
    out, var = hajek_attention(q.float(), k.float(), (v + 300.0).float(), log_pi.float())
    np.testing.assert_allclose(var.numpy(), ref_var, rtol=2e-2, atol=1e-5)


def _sampled_first(k, v, log_pi):
    """Permute slots so that every row's sampled (0 < π < 1) slots come first; returns k, v, log_pi, t."""
    sampled = (log_pi < 0) & torch.isfinite(log_pi)
    order = torch.argsort((~sampled).to(torch.uint8), dim=-1, stable=True)
    k = k.gather(-2, order.unsqueeze(-1).expand_as(k))
    v = v.gather(-2, order.unsqueeze(-1).expand_as(v))
    return k, v, log_pi.gather(-1, order), int(sampled.sum(-1).max())


@pytest.mark.parametrize(("dtype", "offset", "rtol", "atol"),
                         [(torch.float64, 0.0, 1e-9, 1e-13), (torch.float32, 0.0, 1e-4, 1e-7),
                          (torch.float32, 300.0, 2e-2, 1e-5)])
@pytest.mark.parametrize("seed", [0, 3])
def test_trace_path_matches_reference(seed, dtype, offset, rtol, atol):
    """The in-call variance (the sampled prefix only; per coordinate and trace only) against the per-row reference.

    Slots after the first t are certain or padding; the +300 value offset checks that the sums, taken around
    the rows' mean output, do not cancel catastrophically in float32.
    """
    q, k, v, log_pi = random_case(batch=(2, 3), m=4, n=23, dv=6, seed=seed)
    k, v, log_pi, t = _sampled_first(k, v, log_pi + 0.0)
    v = v + offset
    ref_out, ref_var = reference(q, k, v, log_pi)
    q, k, v, log_pi = (x.to(dtype) for x in (q, k, v, log_pi))
    scale = 1.0 / math.sqrt(q.shape[-1])
    tail = one_minus_pi(log_pi[..., :t])
    bias = offset_bias(log_pi).unsqueeze(-2)
    out_c, var_c, terms_c = hajek_with_variance(q, k, v, bias, scale, tail, per_coordinate=True)
    out_t, var_t, terms_t = hajek_with_variance(q, k, v, bias, scale, tail, per_coordinate=False)
    assert var_c.shape == (2, 3, 4, 6) and var_t.shape == (2, 3, 4, 1) and terms_t.shape == (2, 3, 4, 2)
    assert torch.equal(terms_c, terms_t)
    assert out_t.dtype == var_t.dtype == dtype
    np.testing.assert_allclose(out_t.numpy(), ref_out, rtol=0 if dtype == torch.float64 else 1e-6,
                               atol=1e-10 if dtype == torch.float64 else 1e-4)
    np.testing.assert_allclose(var_t[..., 0].numpy(), ref_var.sum(-1), rtol=rtol, atol=atol)
    np.testing.assert_allclose(var_c.numpy(), ref_var, rtol=rtol, atol=atol)
    assert (ref_var.sum(-1) > 1e-3).any()


def test_trace_path_without_sampled_slots_is_zero():
    q, k, v, _ = random_case(seed=9)
    log_pi = torch.zeros(k.shape[:-1], dtype=torch.float64)
    out, var, terms = hajek_with_variance(q, k, v, offset_bias(log_pi).unsqueeze(-2), 0.5, one_minus_pi(log_pi[..., :0]),
                                          per_coordinate=False)
    assert bool((var == 0).all()) and bool((terms == 0).all()) and bool(torch.isfinite(out).all())


def test_large_logits_are_stable():
    q, k, v, log_pi = random_case(seed=7)
    out, var = hajek_attention(q * 200.0, k, v, log_pi)
    ref_out, ref_var = reference(q * 200.0, k, v, log_pi)
    assert torch.isfinite(out).all() and torch.isfinite(var).all()
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-9)


def test_all_certain_rows_have_zero_variance_and_equal_softmax_attention():
    q, k, v, _ = random_case(seed=8)
    log_pi = torch.zeros(k.shape[:-1], dtype=torch.float64)
    out, var = hajek_attention(q, k, v, log_pi)
    assert bool((var == 0).all())
    plain = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-12)


def test_constant_pi_is_plain_attention_over_the_sample():
    """The ratio estimator is invariant to a common π: the offset then changes nothing."""
    q, k, v, _ = random_case(seed=9)
    log_pi = torch.full(k.shape[:-1], math.log(0.4), dtype=torch.float64)
    out, var = hajek_attention(q, k, v, log_pi)
    plain = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-12)
    assert bool((var > 0).all())


def test_single_retained_tail_token():
    g = torch.Generator().manual_seed(10)
    q = torch.randn(1, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 6, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, 6, 3, generator=g, dtype=torch.float64)
    # Row: two certain tokens, one sampled tail token (π = 0.2), three padding slots.
    log_pi = torch.tensor([[0.0, math.log(0.2), float("-inf"), 0.0, float("-inf"), float("-inf")]], dtype=torch.float64)
    out, var = hajek_attention(q, k, v, log_pi)
    ref_out, ref_var = reference(q, k, v, log_pi)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-12)
    np.testing.assert_allclose(var.numpy(), ref_var, rtol=1e-10, atol=1e-15)
    # Explicitly: only slot 1 contributes, with (1 − π) a² (v − ô)².
    w = torch.exp(q[0] @ k[0].T / 2.0)[:, [0, 1, 3]] / torch.tensor([1.0, 0.2, 1.0], dtype=torch.float64)
    a = w / w.sum(-1, keepdim=True)
    o = a @ v[0, [0, 1, 3]]
    torch.testing.assert_close(var[0], 0.8 * a[:, 1:2] ** 2 * (v[0, 1] - o) ** 2, rtol=1e-10, atol=1e-15)
    # A row whose only retained slot is a tail token: ô = v_i and V̂ = (1 − π)(v_i − ô)² = 0.
    only = torch.tensor([[float("-inf"), math.log(0.3), float("-inf"), float("-inf"), float("-inf"), float("-inf")]], dtype=torch.float64)
    out1, var1 = hajek_attention(q, k, v, only)
    torch.testing.assert_close(out1[0], v[0, 1].expand(2, 3), rtol=0, atol=1e-12)
    assert float(var1.abs().max()) <= 1e-15  # zero up to float64 rounding of the expanded sums


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_give_float32(dtype):
    q, k, v, log_pi = random_case(seed=11)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, var = hajek_attention(q, k, v, log_pi.to(dtype))
    assert out.dtype == torch.float32 and var.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(var).all() and bool((var >= 0).all())
    # Against the reference on the rounded inputs (log π rounded as well).
    ref_out, ref_var = reference(q, k, v, log_pi.to(dtype))
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-4)
    np.testing.assert_allclose(var.numpy(), ref_var, rtol=1e-3, atol=1e-5)


def test_empty_row_raises():
    q, k, v, log_pi = random_case(seed=12)
    log_pi = log_pi.clone()
    log_pi[1, 2, :] = float("-inf")
    with pytest.raises(EmptyRetainedSetError):
        hajek_attention(q, k, v, log_pi)
    assert issubclass(EmptyRetainedSetError, ValueError)


def test_invalid_inputs_raise():
    q, k, v, log_pi = random_case(seed=13)
    bad = log_pi.clone()
    bad[0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        hajek_attention(q, k, v, bad)
    bad = log_pi.clone()
    bad[0, 0, 3] = 0.5
    with pytest.raises(ValueError):
        hajek_attention(q, k, v, bad)
    with pytest.raises(ValueError):
        hajek_attention(q, k, v[..., :-1, :], log_pi)


def test_certificate_is_chebyshev_bound():
    trace = torch.tensor([0.0, 0.01, 2.5, -1e-12])
    cert = certificate(trace, 0.05)
    torch.testing.assert_close(cert, torch.sqrt(torch.tensor([0.0, 0.01, 2.5, 0.0]) / 0.05))
    torch.testing.assert_close(certificate(trace[1:3], 0.2), torch.sqrt(trace[1:3] / 0.2))
    for delta in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError):
            certificate(trace, delta)


def test_row_blocks_give_the_unblocked_result(monkeypatch):
    """A multi-token pass is computed in row blocks to bound its logits; the blocks change nothing but rounding."""
    import kvcert.estimator as estimator

    q, k, v, log_pi = random_case(batch=(2, 3), m=7, n=23, dv=6, seed=5)
    k, v, log_pi, t = _sampled_first(k, v, log_pi + 0.0)
    q, k, v, log_pi = (x.float() for x in (q, k, v, log_pi))
    bias = offset_bias(log_pi).unsqueeze(-2).expand(2, 3, 7, 23).clone()
    bias[..., :3, -2:] = float("-inf")  # a row-dependent mask, so the bias is split with the rows
    whole = hajek_with_variance(q, k, v, bias, 0.3, one_minus_pi(log_pi[..., :t]))
    monkeypatch.setattr(estimator, "ROW_BLOCK_ELEMENTS", 2 * 23 * 6)  # two rows per block
    blocked = hajek_with_variance(q, k, v, bias, 0.3, one_minus_pi(log_pi[..., :t]))
    for a, b in zip(whole, blocked):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_caches_are_read_in_leading_blocks(monkeypatch, dtype):
    """A bfloat16/float16 cache is converted to float32 one block of its leading dimension at a time (no float32
    copy of a whole layer's keys and values); the blocks change nothing: rows are independent."""
    import kvcert.estimator as estimator

    q, k, v, log_pi = random_case(batch=(6,), m=3, n=23, dv=6, seed=11)
    k, v, log_pi, t = _sampled_first(k, v, log_pi + 0.0)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    bias = offset_bias(log_pi.float()).unsqueeze(-2)
    tail = one_minus_pi(log_pi.float()[..., :t])
    whole = hajek_with_variance(q, k, v, bias, 0.3, tail)
    calls = []
    real = estimator.hajek_with_weights
    monkeypatch.setattr(estimator, "hajek_with_weights", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    monkeypatch.setattr(estimator, "CONVERT_BLOCK_ELEMENTS", 2 * 23 * 8)  # two leading rows (n x d keys) per block
    blocked = hajek_with_variance(q, k, v, bias, 0.3, tail)
    assert calls == [2, 2, 2]
    calls.clear()
    monkeypatch.setattr(estimator, "CONVERT_BLOCK_ELEMENTS", 23 * 8)  # one row per block, but at most 4 blocks
    capped = hajek_with_variance(q, k, v, bias, 0.3, tail)
    assert calls == [2, 2, 2]  # ceil(6 / 4) rows per block, and a block is not split again
    for a, b in zip(whole, capped):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    for a, b in zip(whole, blocked):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)

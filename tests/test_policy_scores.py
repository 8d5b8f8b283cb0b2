"""Each scoring policy against its paper's formula, written out here independently in float64 numpy.

A hand-built ``LayerView`` has GQA (4 query heads over 2 KV heads: query head h reads KV head h // 2, as
transformers groups them) and a sliding window shorter than the prefix, so that the causal and window masks
both hide keys from some window query. The formulas:

* SnapKV (Li et al., 2024): softmax attention of the observation window (the last w prompt queries) over
  the visible keys, averaged over the window, smoothed by a 1-D average pool of width 5 (zero padding,
  counted), then averaged over the query heads of each KV head;
* TOVA (Oren et al., 2024): the attention of the last prompt token alone, averaged over the query heads (of each
  KV head by default; of the whole layer with heads="all");
* H2O (Zhang et al., 2023): the attention each key received, summed over every prefill query, averaged
  over the query heads. Besides the hand-built view, the accumulation itself is checked through
  ``kvcert.prefill(..., accumulate=True)`` on a tiny Gemma3 (one sliding-window layer, one full layer)
  with a prompt longer than the 256-query chunks it is accumulated in, against attention recomputed from
  the queries and keys captured in the prefill;
* Knorm (Devoto et al., 2024): 1 / ‖k‖ per KV head; StreamingLLM: recency; uniform: a constant.

The query-head merge is a mean: a maximum over the heads of a KV head (or over the window) gives other
scores here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.attention import interposed
from helpers.seeding import assert_seeded_zero_without_a_generator
from helpers.tiny_models import build, prompt

import kvcert
from kvcert.attention import kvcert_attention
from kvcert.policies import LayerView, get_policy

N, W, D, SLIDING = 20, 6, 8, 7  # prefix length, observation window, head dim, sliding window
HQ, HK = 4, 2
RTOL, ATOL = 2e-5, 1e-7  # the policies compute in float32


def _view(sliding: int | None = SLIDING, seed: int = 0) -> LayerView:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HK, N, D, generator=g)
    values = torch.randn(1, HK, N, D, generator=g)
    queries = 2.0 * torch.randn(1, HQ, W, D, generator=g)  # peaked attention: heads and window rows differ
    accumulated = torch.rand(1, HQ, N, generator=g) * 5
    return LayerView(keys=keys, values=values, window_queries=queries, accumulated_attention=accumulated,
                     scale=1 / math.sqrt(D), sliding_window=sliding)


def _attention(q: np.ndarray, k: np.ndarray, positions: np.ndarray, scale: float, sliding: int | None) -> np.ndarray:
    """Softmax attention rows of queries at ``positions`` over keys 0..n-1, per query head.

    q: (hq, m, d); k: (hk, n, d); positions: (m,) ints. Returns (hq, m, n); query head h reads KV head
    h // (hq / hk).
    """
    hq, m, _ = q.shape
    hk, n, _ = k.shape
    out = np.zeros((hq, m, n))
    for h in range(hq):
        kv = h // (hq // hk)
        for j, p in enumerate(positions):
            visible = [i for i in range(n) if i <= p and (sliding is None or i > p - sliding)]
            logits = scale * (k[kv, visible] @ q[h, j])
            weights = np.exp(logits - logits.max())
            out[h, j, visible] = weights / weights.sum()
    return out


def _group_mean(per_query_head: np.ndarray) -> np.ndarray:
    """(hq, n) -> (hk, n): the mean over the query heads of each KV head (written as a loop on purpose)."""
    hq, n = per_query_head.shape
    group = hq // HK
    return np.stack([np.mean([per_query_head[kv * group + r] for r in range(group)], axis=0) for kv in range(HK)])


def _pool5(x: np.ndarray) -> np.ndarray:
    """Average over positions i-2..i+2, zeros beyond the ends counted in the width of 5."""
    n = x.shape[-1]
    return np.stack([x[..., max(0, i - 2): i + 3].sum(-1) / 5 for i in range(n)], axis=-1)


def _window_attention(view: LayerView) -> np.ndarray:
    q = view.window_queries[0].double().numpy()
    k = view.keys[0].double().numpy()
    return _attention(q, k, np.arange(N - W, N), view.scale, view.sliding_window)


def _score(name: str, view: LayerView) -> np.ndarray:
    return get_policy(name).score(view)[0].double().numpy()  # (hk, n)


def snapkv_reference(view: LayerView) -> np.ndarray:
    return _group_mean(_pool5(_window_attention(view).mean(axis=1)))


def test_the_example_exercises_the_masks_and_the_heads():
    """The sliding window hides keys that causality alone would show, and the heads of a KV head differ."""
    view = _view()
    attn = _window_attention(view)
    unwindowed = _attention(view.window_queries[0].double().numpy(), view.keys[0].double().numpy(),
                            np.arange(N - W, N), view.scale, None)
    assert (attn == 0).any() and not np.allclose(attn, unwindowed)
    assert np.abs(attn[0] - attn[1]).max() > 0.05  # query heads 0 and 1 share KV head 0
    assert np.abs(attn[:, 0] - attn[:, -1]).max() > 0.05  # window rows differ


@pytest.mark.parametrize("sliding", [SLIDING, None])
def test_snapkv_is_pooled_window_attention_averaged_over_query_heads(sliding):
    view = _view(sliding)
    expected = snapkv_reference(view)
    np.testing.assert_allclose(_score("snapkv", view), expected, rtol=RTOL, atol=ATOL)
    # Pinned choices: a max over the window, over the heads of a KV head, or no pooling give other scores.
    attn = _window_attention(view)
    for other in (_group_mean(_pool5(attn.max(axis=1))),
                  np.stack([_pool5(attn.mean(axis=1))[2 * kv: 2 * kv + 2].max(0) for kv in range(HK)]),
                  _group_mean(attn.mean(axis=1))):
        assert np.abs(other - expected).max() > 1e-3


def test_tova_is_the_last_queries_attention_averaged_over_query_heads():
    view = _view()
    expected = _group_mean(_window_attention(view)[:, -1, :])
    np.testing.assert_allclose(_score("tova", view), expected, rtol=RTOL, atol=ATOL)
    assert np.abs(_group_mean(_window_attention(view)[:, -2, :]) - expected).max() > 1e-3


def test_tova_over_all_heads_is_one_score_for_every_kv_head():
    """heads="all": the mean over every query head of the layer, as the TOVA paper's code and kvpress average."""
    view = _view()
    last = _window_attention(view)[:, -1, :]  # (hq, n)
    expected = np.stack([np.mean([last[h] for h in range(HQ)], axis=0)] * HK)
    scores = get_policy("tova", heads="all").score(view)[0].double().numpy()
    np.testing.assert_allclose(scores, expected, rtol=RTOL, atol=ATOL)
    assert np.abs(scores - _score("tova", view)).max() > 1e-3  # not the default's per-KV-head mean
    with pytest.raises(ValueError, match="heads='query'"):
        get_policy("tova", heads="query")


def test_h2o_averages_the_accumulated_attention_over_query_heads():
    view = _view()
    acc = view.accumulated_attention[0].double().numpy()
    np.testing.assert_allclose(_score("h2o", view), _group_mean(acc), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="accumulated attention"):
        get_policy("h2o").score(LayerView(view.keys, view.values, view.window_queries, None, view.scale))


def test_knorm_streaming_and_uniform():
    view = _view()
    k = view.keys[0].double().numpy()
    np.testing.assert_allclose(_score("knorm", view), 1 / np.sqrt((k ** 2).sum(-1)), rtol=RTOL)
    np.testing.assert_array_equal(_score("streamingllm", view), np.tile(np.arange(1, N + 1), (HK, 1)))
    uniform = _score("uniform", view)
    assert uniform.shape == (HK, N) and (uniform == uniform.flat[0]).all() and uniform.flat[0] > 0


def test_streaming_topk_keeps_the_sinks_and_the_latest_tokens():
    """StreamingLLM under the topk design: the same positions in every head, the first sinks and the last ones."""
    from kvcert.designs import DesignOptions, topk_design

    scores = get_policy("streamingllm").score(_view())
    options = DesignOptions(n_sink=2, n_recent=3)
    sel = topk_design(scores, 0.5, options, generator=torch.Generator().manual_seed(0))
    expected = list(range(2)) + list(range(N - 8, N))  # 10 slots: 2 sinks, then the latest 8
    for kv in range(HK):
        assert sel.index[0, kv].tolist() == expected


# --------------------------------------------------------------------------- through the prefill


@pytest.fixture(scope="module")
def captured_prefill():
    """A 300-token prefill (more than one 256-query chunk) of a tiny Gemma3 whose layer 0 has a 96-token
    sliding window; every attention call's queries and keys are captured as the prefill runs."""
    _, model, _ = build("gemma3", seed=3, window=96)
    calls = []

    def capture(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        calls.append((module.layer_idx, query.detach().double()[0], key.detach().double()[0], float(scaling),
                      kwargs.get("sliding_window")))
        return kvcert_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    context, question = prompt(21, n_context=290, n_question=10)
    ids = torch.cat([context, question], -1)
    with interposed(capture):  # the prefill attaches "kvcert": the wrapper records every call
        state = kvcert.prefill(model, ids, observation_window=16, accumulate=True)
    assert state.context_tokens == 300 > 256
    assert [c[4] for c in calls] == [96, None]  # layer 0 sliding, layer 1 full
    return state, calls


def test_h2o_accumulates_over_every_prefill_query(captured_prefill):
    state, calls = captured_prefill
    scores = state.scores("h2o")
    for layer, q, k, scale, sliding in calls:
        n = k.shape[1]
        attn = _attention(q.numpy(), k.numpy(), np.arange(n), scale, sliding)  # (hq, n, n)
        expected = _group_mean(attn.sum(axis=1))
        np.testing.assert_allclose(scores[layer][0].double().numpy(), expected, rtol=1e-4, atol=1e-5)
        # The queries past the first 256 carry weight: leaving them out changes every late key's score.
        partial = _group_mean(attn[:, :256].sum(axis=1))
        assert np.abs(partial - expected).max() > 0.1


def test_snapkv_and_tova_read_the_last_prefill_queries(captured_prefill):
    state, calls = captured_prefill
    window = 16
    for layer, q, k, scale, sliding in calls:
        n = k.shape[1]
        attn = _attention(q[:, -window:].numpy(), k.numpy(), np.arange(n - window, n), scale, sliding)
        snapkv = _group_mean(_pool5(attn.mean(axis=1)))
        np.testing.assert_allclose(state.scores("snapkv")[layer][0].double().numpy(), snapkv, rtol=1e-4, atol=1e-7)
        tova = _group_mean(attn[:, -1])
        np.testing.assert_allclose(state.scores("tova")[layer][0].double().numpy(), tova, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------- ExpectedAttention, CriticalKV, ObservedAttention

HIDDEN, ATTENTION_SCALING = 12, 1.3  # output projection width; a RoPE scaling (cos² + sin² ≠ 1), as YaRN's


def _rope_tables(n_positions: int, rotary_dims: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (n_positions, rotary_dims) of transformers' RoPE (base 10000, halves repeated), scaled."""
    theta = 1.0 / 10000 ** (np.arange(0, rotary_dims, 2) / rotary_dims)
    angles = np.arange(n_positions)[:, None] * np.concatenate([theta, theta])[None, :]
    return ATTENTION_SCALING * np.cos(angles), ATTENTION_SCALING * np.sin(angles)


def _rotation(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """(D, D): the matrix of q -> q·cos + rotate_half(q)·sin on the first r dims, identity on the rest."""
    r, half = cos.shape[-1], cos.shape[-1] // 2
    out = np.eye(D)
    for i in range(half):
        out[i, i], out[i, i + half] = cos[i], -sin[i]
        out[i + half, i + half], out[i + half, i] = cos[i + half], sin[i + half]
    return out


def _scorer_view(rotary_dims: int = D, seed: int = 1) -> tuple[LayerView, np.ndarray, np.ndarray]:
    """The hand-built view with query statistics and an output projection, and the queries before RoPE
    (HQ, N, D) and the rotary tables (N + FUTURE_POSITIONS, r) it was built from. The queries are recorded in
    two calls, as a prefill in two chunks would."""
    from kvcert.query_statistics import FUTURE_POSITIONS, QueryStatistics

    view = _view(seed=seed)
    g = np.random.default_rng(seed)
    plain = g.normal(size=(HQ, N, D)) + g.normal(size=(HQ, 1, D))  # a mean that is not zero
    cos, sin = _rope_tables(N + FUTURE_POSITIONS, rotary_dims)
    rotated = np.stack([[_rotation(cos[p], sin[p]) @ plain[h, p] for p in range(N)] for h in range(HQ)])
    stats = QueryStatistics((torch.tensor(cos, dtype=torch.float32), torch.tensor(sin, dtype=torch.float32)))
    queries = torch.tensor(rotated, dtype=torch.float32).unsqueeze(0)
    for chunk in (slice(0, 11), slice(11, N)):
        stats.add(queries[..., chunk, :], torch.arange(N)[chunk])
    stats.finish(N)
    projection = torch.tensor(g.normal(size=(HIDDEN, HQ * D)), dtype=torch.float32)
    view = LayerView(view.keys, view.values, view.window_queries, view.accumulated_attention, view.scale,
                     view.sliding_window, query_statistics=stats, output_projection=projection)
    return view, plain, (cos, sin)


def expected_attention_reference(view, plain, tables, n_sink=4, n_future=512, covariance=True, vnorm=True):
    """Devoto et al.'s expected attention, written out: (HK, N)."""
    cos, sin = tables
    rbar = np.mean([_rotation(cos[t], sin[t]) for t in range(N, N + n_future)], axis=0)
    k = view.keys[0].double().numpy()
    v = view.values[0].double().numpy()
    s = view.scale
    per_head = []
    for h in range(HQ):
        q = plain[h, n_sink:]
        mu = q.mean(0)
        sigma = (q - mu).T @ (q - mu) / len(q)
        mu, sigma = rbar @ mu, rbar @ sigma @ rbar.T
        keys = k[h // (HQ // HK), n_sink:]
        logits = np.array([s * mu @ kj + (s * s / 2 * kj @ sigma @ kj if covariance else 0.0) for kj in keys])
        weights = np.exp(logits - logits.max())
        per_head.append(weights / weights.sum())
    scores = _group_mean(np.stack(per_head))
    if vnorm:
        scores = scores * np.sqrt((v[:, n_sink:] ** 2).sum(-1))
    return np.concatenate([np.repeat(scores.max(-1, keepdims=True), n_sink, axis=-1), scores], axis=-1)


@pytest.mark.parametrize("rotary_dims", [D, D // 2])  # full and partial rotary
def test_expected_attention_is_the_gaussian_expectation_under_averaged_rope(rotary_dims):
    view, plain, tables = _scorer_view(rotary_dims)
    expected = expected_attention_reference(view, plain, tables)
    np.testing.assert_allclose(_score("expected_attention", view), expected, rtol=RTOL, atol=ATOL)
    options = dict(n_sink=2, n_future_positions=64, use_covariance=False, use_vnorm=False)
    scores = get_policy("expected_attention", **options).score(view)[0].double().numpy()
    reference = expected_attention_reference(view, plain, tables, n_sink=2, n_future=64, covariance=False,
                                             vnorm=False)
    np.testing.assert_allclose(scores, reference, rtol=RTOL, atol=ATOL)
    # Pinned: each option changes the scores, and the queries' positions matter (RoPE is not ignored).
    for other in (dict(options, n_sink=3), dict(options, n_future_positions=1), dict(options, use_covariance=True)):
        assert np.abs(get_policy("expected_attention", **other).score(view)[0].double().numpy() - scores).max() > 1e-4
    unrotated = expected_attention_reference(view, plain, (np.ones_like(tables[0]), np.zeros_like(tables[1])))
    assert np.abs(unrotated - expected).max() > 1e-4


def test_expected_attention_refuses_bad_options_and_missing_statistics():
    for options, match in ((dict(n_sink=17), "n_sink=17"), (dict(n_future_positions=0), "n_future_positions=0"),
                           (dict(epsilon=-1.0), "epsilon=-1.0")):
        with pytest.raises(ValueError, match=match):
            get_policy("expected_attention", **options)
    with pytest.raises(ValueError, match="query statistics"):
        _score("expected_attention", _view())


def test_criticalkv_reweights_the_base_by_the_projected_value_norm():
    view, _, _ = _scorer_view()
    w = view.output_projection.double().numpy()  # (HIDDEN, HQ·D)
    v = view.values[0].double().numpy()
    projected = np.stack([np.abs(v[h // (HQ // HK)] @ w[:, h * D: (h + 1) * D].T).sum(-1) for h in range(HQ)])
    norm = _group_mean(projected)  # (HK, N)
    np.testing.assert_allclose(_score("criticalkv", view), (snapkv_reference(view) + 1e-4) * norm, rtol=RTOL,
                               atol=ATOL)
    knorm_based = get_policy("criticalkv", base="knorm", epsilon=0.5).score(view)[0].double().numpy()
    k = view.keys[0].double().numpy()
    np.testing.assert_allclose(knorm_based, (1 / np.sqrt((k ** 2).sum(-1)) + 0.5) * norm, rtol=RTOL)
    # the L1 norm over the hidden units, not the L2 norm
    l2 = _group_mean(np.stack([np.sqrt(((v[h // 2] @ w[:, h * D: (h + 1) * D].T) ** 2).sum(-1)) for h in range(HQ)]))
    assert np.abs(l2 - norm).max() > 1e-3
    assert get_policy("criticalkv", base="h2o").needs_accumulated_attention
    assert get_policy("criticalkv", base="expected_attention").needs_query_statistics
    for options, match in ((dict(base="criticalkv"), "base='criticalkv'"), (dict(base="x"), "base='x'"),
                           (dict(epsilon=float("inf")), "epsilon=inf")):
        with pytest.raises(ValueError, match=match):
            get_policy("criticalkv", **options)
    with pytest.raises(ValueError, match="output projection"):
        _score("criticalkv", _view())


def test_observed_attention_is_the_mean_over_the_queries_that_follow_each_key():
    view = _view()
    acc = view.accumulated_attention[0].double().numpy()
    expected = _group_mean(np.stack([[acc[h, j] / (N - j) for j in range(N)] for h in range(HQ)]))
    np.testing.assert_allclose(_score("observed_attention", view), expected, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="accumulated attention"):
        get_policy("observed_attention").score(LayerView(view.keys, view.values, view.window_queries, None, view.scale))


def test_expected_attention_statistics_through_the_prefill(captured_prefill):
    """On the tiny Gemma3 (sliding and full layers with their own RoPE bases), a second prefill that collects
    the query statistics: its un-rotated queries, rotated back by the layer's rotary tables, are the queries
    the attention calls saw, and the first prefill's scores are unchanged by collecting them."""
    state, calls = captured_prefill
    _, model, _ = build("gemma3", seed=3, window=96)
    ids = state.prefix_ids
    with_stats = kvcert.prefill(model, ids, observation_window=16, accumulate=True, query_statistics=True)
    assert state.observations[0].query_statistics is None  # not collected unless asked
    from kvcert.query_statistics import rotary_tables

    tables = rotary_tables(model, ids.shape[-1])
    assert not torch.equal(tables[0][0], tables[1][0])  # local and global RoPE differ
    for layer, q, _, _, _ in calls:
        stats = with_stats.observations[layer].query_statistics
        cos, sin = (t.double() for t in tables[layer])
        mean, cov = stats.moments(0)
        plain = (q * cos - torch.cat([-q[..., 8:], q[..., :8]], -1) * sin) / (cos ** 2 + sin ** 2)
        np.testing.assert_allclose(mean[0].numpy(), plain.mean(1).numpy(), rtol=1e-4, atol=1e-5)
        centred = plain - plain.mean(1, keepdim=True)
        np.testing.assert_allclose(cov[0].numpy(), (centred.transpose(1, 2) @ centred / q.shape[1]).numpy(),
                                   rtol=1e-4, atol=1e-5)
    for name in ("snapkv", "h2o"):
        for mine, before in zip(with_stats.scores(name), state.scores(name)):
            torch.testing.assert_close(mine, before)
    assert all(torch.isfinite(s).all() for s in with_stats.scores("expected_attention"))


# --------------------------------------------------------------------------- KeyDiff, LagKV, CUR (keys and values only)


def _states(view: LayerView) -> tuple[np.ndarray, np.ndarray]:
    """(hk, n, d) float64 keys and values of the view's one batch row."""
    return view.keys[0].double().numpy(), view.values[0].double().numpy()


def test_keydiff_is_one_minus_the_cosine_to_the_mean_unit_key():
    """KeyDiff (Park et al., 2025): per KV head, 1 - cos(k_i, a) with a the mean of the keys scaled to unit length."""
    view = _view()
    keys, _ = _states(view)
    expected = np.zeros((HK, N))
    for kv in range(HK):
        anchor = np.mean([k / math.sqrt(k @ k) for k in keys[kv]], axis=0)
        for i, k in enumerate(keys[kv]):
            expected[kv, i] = 1 - (k @ anchor) / math.sqrt((k @ k) * (anchor @ anchor))
    np.testing.assert_allclose(_score("keydiff", view), expected, rtol=RTOL, atol=1e-6)
    # the anchor is the mean direction, not the mean key: the mean key gives other scores here
    mean_key = keys.mean(axis=1, keepdims=True)
    cos_mean_key = (keys * mean_key).sum(-1) / np.linalg.norm(keys, axis=-1) / np.linalg.norm(mean_key, axis=-1)
    assert np.abs((1 - cos_mean_key) - expected).max() > 1e-3


def _lagkv_reference(view: LayerView, n_sink: int, lag: int, cross: bool) -> np.ndarray:
    """LagKV (Liang et al., 2025) written out token by token: (hk, n)."""
    keys, values = _states(view)
    out = np.ones((HK, N))
    if N < n_sink + 2 * lag:  # no partition has a successor: recency after the sinks
        out[:, n_sink:] = np.arange(N - n_sink) / (N - n_sink)
        return out
    partitions = (N - n_sink) // lag
    for kv in range(HK):
        for p in range(partitions - 1):
            start = n_sink + p * lag
            spreads = np.zeros(lag)
            for states in (keys[kv], values[kv]):
                ref = states[start + lag: start + 2 * lag]
                low, high = ref.min(axis=0), ref.max(axis=0)
                live = high > low  # a channel without range in the reference partition is left out
                std = np.array([np.std((states[start + t, live] - low[live]) / (high - low)[live], ddof=1)
                                for t in range(lag)])
                spreads += np.exp(std) / np.exp(std).sum() / 2  # softmax over the partition, mean of keys and values
            if not cross:
                spreads = np.array([(spreads < s).sum() for s in spreads]) / lag  # rank within the partition
            out[kv, start: start + lag] = spreads
    return out


@pytest.mark.parametrize("options", [dict(n_sink=2, lag_size=4), dict(n_sink=3, lag_size=4, cross_scoring=True),
                                     dict(n_sink=0, lag_size=5), dict(n_sink=2, lag_size=10)],
                         ids=["ranks", "cross", "no-sinks-dead-channel", "too-short"])
def test_lagkv_scores_each_partition_against_the_next(options):
    view = _view()
    if options["n_sink"] == 0:  # and a key channel that is zero everywhere (as a norm's zero weight makes one)
        keys = view.keys.clone()
        keys[:, 0, :, 1] = 0
        view = LayerView(keys, view.values, view.window_queries, None, view.scale, view.sliding_window)
    expected = _lagkv_reference(view, options["n_sink"], options["lag_size"], options.get("cross_scoring", False))
    scores = get_policy("lagkv", **options).score(view)[0].double().numpy()
    np.testing.assert_allclose(scores, expected, rtol=RTOL, atol=ATOL)
    assert (expected < 1).sum() >= 8  # scored, not all ones
    partitioned = options["n_sink"] + 2 * options["lag_size"] <= N
    assert (np.abs(expected[0] - expected[1]).max() > 0) == partitioned  # ranked per KV head, or the recency ramp


def test_lagkv_and_cur_reject_bad_options():
    for name, options, message in [("lagkv", {"lag_size": 1}, "lag_size=1"), ("lagkv", {"n_sink": -1}, "n_sink=-1"),
                                   ("lagkv", {"cross_scoring": "yes"}, "cross_scoring='yes'"),
                                   ("cur", {"leverage": "both"}, "leverage='both'"),
                                   ("cur", {"local_window_size": 0}, "local_window_size=0"),
                                   ("cur", {"sketch_dimension": 2.5}, "sketch_dimension=2.5")]:
        with pytest.raises(ValueError, match=message):
            get_policy(name, **options)


def _cur_reference(keys: np.ndarray, values: np.ndarray, leverage: str, window: int | None) -> np.ndarray:
    """CurDKV (Sengupta et al., 2025) as kvpress approximates its leverage scores: (hk, n)."""
    def shares(mass):  # each token's squared norm over its block's total
        if window is None:
            return mass
        out = np.zeros_like(mass)
        for start in range(0, mass.shape[-1], window):
            block = mass[:, start: start + window]
            out[:, start: start + window] = block / block.sum(axis=-1, keepdims=True)
        return out

    k2, v2 = shares((keys ** 2).sum(-1)), shares((values ** 2).sum(-1))
    combined = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[leverage]
    return combined / combined.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("leverage", ["key", "value", "kv_avg", "kv_product"])
@pytest.mark.parametrize("window", [3, None])
def test_cur_is_the_normalised_local_leverage(leverage, window):
    view = _view()
    keys, values = _states(view)
    expected = _cur_reference(keys, values, leverage, window)
    scores = get_policy("cur", leverage=leverage, local_window_size=window).score(view)[0].double().numpy()
    np.testing.assert_allclose(scores, expected, rtol=RTOL, atol=ATOL)
    if window is not None:  # the local blocks matter
        assert np.abs(_cur_reference(keys, values, leverage, None) - expected).max() > 1e-4


def test_cur_sketch_is_the_generators_gaussian_projection():
    """sketch_dimension r: keys and values times one (head_dim, r) Gaussian / sqrt(r), drawn first from the generator:
    the same seed gives the same scores, another seed other scores."""
    view = _view()
    keys, values = _states(view)
    sketch = torch.randn(D, 3, generator=torch.Generator().manual_seed(11)).double().numpy() / math.sqrt(3)
    expected = _cur_reference(keys @ sketch, values @ sketch, "kv_product", 16)
    policy = get_policy("cur", sketch_dimension=3)
    scores = policy.score(view, torch.Generator().manual_seed(11))[0].double().numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=ATOL)
    other = policy.score(view, torch.Generator().manual_seed(12))[0].double().numpy()
    assert np.abs(other - expected).max() > 1e-3
    assert_seeded_zero_without_a_generator(lambda g: policy.score(view, g))  # never torch's global generator


# --------------------------------------------------------------------------- Cap, LeverageScore
# * Cap (CAPKV, arXiv:2604.25975): the anchor a = R̄·mean of the queries before RoPE after the n_sink sinks (R̄ the
#   RoPE averaged over the future positions); w_i = exp(τ·(cos(a, k_i) − max_j cos(a, k_j))) over the non-sink
#   post-RoPE keys; score w_i·v_iᵀ(I + Σ_j (w_j + ε) v_j v_jᵀ)⁻¹v_i, averaged over the query heads of each KV head;
#   the sinks get the head's highest score.
# * LeverageScore (Chari & Van Durme, 2025): the ridge leverage diag(X (XᵀX + λI)⁻¹ Xᵀ) of the keys before RoPE,
#   centred over the sequence (and sketched: X·Φ, Φ the generator's Gaussian (d, r) / √r).


def cap_reference(view, plain, tables, tau=5.0, n_sink=4, n_future=512, epsilon=1e-6):
    """CAPKV's score, written out: (HK, N)."""
    cos, sin = tables
    rbar = np.mean([_rotation(cos[t], sin[t]) for t in range(N, N + n_future)], axis=0)
    k, v = _states(view)
    per_head = []
    for h in range(HQ):
        anchor = rbar @ plain[h, n_sink:].mean(0)
        keys, values = k[h // (HQ // HK), n_sink:], v[h // (HQ // HK), n_sink:]
        cosine = keys @ anchor / np.linalg.norm(keys, axis=-1) / np.linalg.norm(anchor)
        weights = np.exp(tau * (cosine - cosine.max()))
        capacity = np.eye(D) + sum((w + epsilon) * np.outer(vj, vj) for w, vj in zip(weights, values))
        inverse = np.linalg.inv(capacity)
        per_head.append(np.array([w * vj @ inverse @ vj for w, vj in zip(weights, values)]))
    scores = _group_mean(np.stack(per_head))
    return np.concatenate([np.repeat(scores.max(-1, keepdims=True), n_sink, axis=-1), scores], axis=-1)


@pytest.mark.parametrize("rotary_dims", [D, D // 2])
def test_cap_is_the_anchor_weighted_value_leverage(rotary_dims):
    view, plain, tables = _scorer_view(rotary_dims)
    np.testing.assert_allclose(_score("cap", view), cap_reference(view, plain, tables), rtol=RTOL, atol=ATOL)
    options = dict(tau=2.0, n_sink=2, n_future_positions=64, epsilon=0.5)
    scores = get_policy("cap", **options).score(view)[0].double().numpy()
    np.testing.assert_allclose(scores, cap_reference(view, plain, tables, 2.0, 2, 64, 0.5), rtol=RTOL, atol=ATOL)
    for other in (dict(options, tau=3.0), dict(options, n_sink=3), dict(options, n_future_positions=1),
                  dict(options, epsilon=0.0)):  # each option changes the scores
        assert np.abs(get_policy("cap", **other).score(view)[0].double().numpy() - scores).max() > 1e-5
    assert get_policy("cap").needs_query_statistics and not get_policy("cap").needs_pre_rope_keys


def test_cap_refuses_bad_options_and_missing_statistics():
    for options, match in ((dict(n_sink=17), "n_sink=17"), (dict(n_future_positions=0), "n_future_positions=0"),
                           (dict(tau=-1.0), "tau=-1.0"), (dict(epsilon=float("nan")), "epsilon=nan")):
        with pytest.raises(ValueError, match=match):
            get_policy("cap", **options)
    with pytest.raises(ValueError, match="query statistics"):
        _score("cap", _view())


def _leverage_view(seed: int = 5) -> tuple[LayerView, np.ndarray]:
    """The hand-built view with keys before RoPE (1, HK, N, D) of another draw, and those keys (HK, N, D)."""
    view = _view()
    pre_rope = torch.randn(1, HK, N, D, generator=torch.Generator().manual_seed(seed)) * 3 + 1
    return LayerView(view.keys, view.values, view.window_queries, None, view.scale, view.sliding_window,
                     pre_rope_keys=pre_rope), pre_rope[0].double().numpy()


def leverage_reference(keys: np.ndarray, ridge: float, sketch: np.ndarray | None = None) -> np.ndarray:
    """(HK, N): diag(X (XᵀX + ridge·I)⁻¹ Xᵀ), X the centred keys of each head (times its sketch (D, r))."""
    out = []
    for h in range(keys.shape[0]):
        x = keys[h] - keys[h].mean(0)
        x = x if sketch is None else x @ sketch[h]
        inverse = np.linalg.inv(x.T @ x + ridge * np.eye(x.shape[1]))
        out.append(np.array([row @ inverse @ row for row in x]))
    return np.stack(out)


def test_leverage_is_the_ridge_leverage_of_the_centred_keys_before_rope():
    view, keys = _leverage_view()
    exact = get_policy("leverage", sketch_dimension=None, ridge=1e-9).score(view)[0].double().numpy()
    np.testing.assert_allclose(exact, leverage_reference(keys, 1e-9), rtol=1e-5, atol=1e-7)
    # a projection's diagonal: each in [0, 1], summing to the rank of the centred keys (D < N)
    np.testing.assert_allclose(exact.sum(-1), D, rtol=1e-5)
    ridged = get_policy("leverage", sketch_dimension=None, ridge=50.0).score(view)[0].double().numpy()
    np.testing.assert_allclose(ridged, leverage_reference(keys, 50.0), rtol=1e-5, atol=1e-7)
    assert (ridged.sum(-1) < D - 0.5).all()  # the ridge shrinks them
    # the sketch: one Gaussian (D, r) / √r per KV head, the generator's first draw
    sketch = torch.randn(1, HK, D, 3, generator=torch.Generator().manual_seed(7))[0].double().numpy() / math.sqrt(3)
    policy = get_policy("leverage", sketch_dimension=3)
    sketched = policy.score(view, torch.Generator().manual_seed(7))[0].double().numpy()
    np.testing.assert_allclose(sketched, leverage_reference(keys, 1e-2, sketch), rtol=1e-5, atol=1e-7)
    assert np.abs(policy.score(view, torch.Generator().manual_seed(8))[0].double().numpy() - sketched).max() > 1e-3
    assert_seeded_zero_without_a_generator(lambda g: policy.score(view, g))  # never torch's global generator
    # the keys before RoPE are read, not the cached keys
    assert np.abs(leverage_reference(_states(view)[0], 1e-9) - exact).max() > 1e-3


def test_leverage_refuses_bad_options_and_missing_keys():
    for options, match in ((dict(sketch_dimension=0), "sketch_dimension=0"), (dict(ridge=0.0), "ridge=0.0")):
        with pytest.raises(ValueError, match=match):
            get_policy("leverage", **options)
    with pytest.raises(ValueError, match="keys before RoPE"):
        _score("leverage", _view())
    assert get_policy("leverage").needs_pre_rope_keys
    assert get_policy("criticalkv", base="leverage").needs_pre_rope_keys


def test_pre_rope_keys_through_the_prefill(captured_prefill):
    """On the tiny Gemma3 (a sliding and a full layer, their own RoPE bases): the keys the prefill keeps before RoPE,
    rotated by the layer's rotary tables, are the keys the attention calls saw; not collected unless asked."""
    from kvcert.query_statistics import rotary_tables

    state, calls = captured_prefill
    assert all(obs.pre_rope_keys is None for obs in state.observations)
    _, model, _ = build("gemma3", seed=3, window=96)
    ids = state.prefix_ids
    with_keys = kvcert.prefill(model, ids, observation_window=16, pre_rope_keys=True)
    tables = rotary_tables(model, ids.shape[-1])
    for layer, _, k, _, _ in calls:
        plain = with_keys.layer_views()[layer].pre_rope_keys[0].double()  # (hk, n, d)
        cos, sin = (t.double() for t in tables[layer])
        rotated = plain * cos + torch.cat([-plain[..., 8:], plain[..., :8]], -1) * sin
        np.testing.assert_allclose(rotated.numpy(), k.numpy(), rtol=1e-4, atol=1e-5)
        assert (plain - k).abs().max() > 1e-2  # RoPE was undone
    assert all(torch.isfinite(s).all() for s in with_keys.scores("leverage"))

"""Budget allocators (kvcert.allocators) with both designs, on seeded scores: the uniform allocator is the
designs' old behaviour exactly, AdaKV pools a layer's heads (top-k keeps the pool's top across heads above
each head's safeguard; Poisson's Σπ over the pool is the pool's count), PyramidKV's layer counts sum to the
uniform total, and bad options fail with one line."""

from __future__ import annotations

import pytest
import torch

from kvcert.allocators import AdaKV, LayerBudget, PyramidKV, Uniform, adakv_safeguard, get_allocator, pyramid_budgets
from kvcert.designs import DesignOptions, poisson_design, topk_design
from kvcert.sampling import certain_mask, inclusion_probabilities, retained_count

OPTIONS = DesignOptions()
N, HEADS = 300, 4


def _scores(seed: int = 0) -> torch.Tensor:
    """(2, HEADS, N) heavy-tailed scores whose heads differ in scale: a pooled ranking favours head 1."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, HEADS, N, generator=g, dtype=torch.float64) ** 4
    scores[:, 1] *= 5.0
    return scores.float()


@pytest.mark.parametrize("design", [topk_design, poisson_design])
def test_the_uniform_allocation_is_the_designs_default(design):
    scores = _scores()
    (budget,) = Uniform().allocate(0.25, N, 1, OPTIONS.n_sink, OPTIONS.n_recent)
    old = design(scores, 0.25, OPTIONS, generator=torch.Generator().manual_seed(3))
    new = design(scores, 0.25, OPTIONS, generator=torch.Generator().manual_seed(3), allocation=budget)
    assert torch.equal(old.index, new.index) and torch.equal(old.log_pi, new.log_pi)


def test_adakv_topk_keeps_the_pools_top_above_each_heads_safeguard():
    scores = _scores()
    count = retained_count(0.25, N)
    (budget,) = AdaKV(alpha_safeguard=0.2).allocate(0.25, N, 1, OPTIONS.n_sink, OPTIONS.n_recent)
    assert budget == LayerBudget(count, pooled=True, safeguard=int(0.2 * count))
    sel = topk_design(scores, 0.25, OPTIONS, allocation=budget)
    kept = sel.retained
    assert kept.sum(-1).tolist() == [HEADS * count] * 2  # the pool's total, per batch row
    assert bool((kept[:, 1] > count).all()) and bool((kept >= budget.safeguard).all())
    certain = certain_mask(N, OPTIONS.n_sink, OPTIONS.n_recent)
    for b in range(2):
        for h in range(HEADS):
            index = sel.index[b, h, : int(kept[b, h])]
            mask = torch.zeros(N, dtype=torch.bool)
            mask[index] = True
            assert bool(mask[certain].all())  # every head keeps its sinks and recent window
        # beyond each head's certain slots and safeguard, the kept scores are the pool's highest
        keep = torch.zeros(HEADS, N, dtype=torch.bool)
        for h in range(HEADS):
            keep[h, sel.index[b, h, : int(kept[b, h])]] = True
        own = certain.expand(HEADS, N).clone()
        for h in range(HEADS):
            ranked = torch.where(certain, torch.tensor(float("inf")), scores[b, h].double())
            own[h, torch.topk(ranked, budget.safeguard).indices] = True
        pooled_kept, pooled_dropped = scores[b][keep & ~own], scores[b][~keep]
        assert float(pooled_kept.min()) >= float(pooled_dropped.max())


def test_adakv_poisson_sums_its_probabilities_over_the_pool():
    scores = _scores(1)
    count = retained_count(0.25, N)
    (budget,) = AdaKV().allocate(0.25, N, 1, OPTIONS.n_sink, OPTIONS.n_recent)
    b, h, n = scores.shape
    own = certain_mask(n, OPTIONS.n_sink, OPTIONS.n_recent).expand(b, h, n).clone()
    for r in range(b):
        for k in range(h):
            ranked = torch.where(own[r, k], torch.tensor(float("inf")), scores[r, k].double())
            own[r, k, torch.topk(ranked, budget.safeguard).indices] = True
    pi = inclusion_probabilities(scores.reshape(b, h * n), h * count, certain=own.reshape(b, h * n)).reshape(b, h, n)
    assert torch.allclose(pi.double().sum((-1, -2)), torch.full((b,), float(h * count), dtype=torch.float64), rtol=1e-5)
    assert bool((pi[own] == 1).all())
    per_head = pi.double().sum(-1)
    assert float(per_head[:, 1].min()) > count > float(per_head[:, 0].max())  # the pool moves budget across heads
    draws = [poisson_design(scores, 0.25, OPTIONS, torch.Generator().manual_seed(s), allocation=budget)
             for s in range(40)]
    for sel in draws:  # the design's π are these π
        got = torch.full((b, h, n), float("nan"))
        for r in range(b):
            for k in range(h):
                valid = torch.isfinite(sel.log_pi[r, k])
                got[r, k, sel.index[r, k][valid]] = torch.exp(sel.log_pi[r, k][valid])
        seen = ~torch.isnan(got)
        assert torch.allclose(got[seen], pi[seen], rtol=1e-6)
    mean_kept = torch.stack([sel.retained.sum(-1) for sel in draws]).double().mean()
    assert abs(float(mean_kept) - h * count) < 0.05 * h * count


@pytest.mark.parametrize("n, layers", [(1000, 24), (4096, 30), (5000, 1)])
def test_pyramidkv_keeps_the_uniform_total(n, layers):
    budget = 0.25
    count = retained_count(budget, n)
    counts = [b.count for b in PyramidKV().allocate(budget, n, layers, OPTIONS.n_sink, OPTIONS.n_recent)]
    assert sum(counts) == layers * count
    assert all(OPTIONS.n_sink + OPTIONS.n_recent <= c <= n for c in counts)
    assert counts == sorted(counts, reverse=True)  # lower layers keep more
    real = pyramid_budgets(count, n, layers, OPTIONS.n_sink + OPTIONS.n_recent, 20)
    assert max(abs(c - r) for c, r in zip(counts, real)) < 1
    if n == 1000:  # count / beta = 12.5 < the 36 certain slots: the pyramid cannot apply
        assert counts == [count] * layers
    elif layers > 1:
        assert counts[0] > counts[-1]


def test_pyramid_formula_matches_its_closed_form():
    # mean 500 over 5 layers, n = 2000, window 10, beta 20: last 25, first 975, steps of 237.5
    assert pyramid_budgets(500, 2000, 5, 10, 20) == [975.0, 737.5, 500.0, 262.5, 25.0]
    # n = 900: capped at n − window = 890, the last raised to 2 · 500 − 890 = 110
    assert pyramid_budgets(500, 900, 3, 10, 20) == [890.0, 500.0, 110.0]
    # a last layer below the window: uniform
    assert pyramid_budgets(100, 900, 3, 10, 20) == [100.0] * 3


def test_adakv_safeguard_follows_the_papers_rounding():
    assert [adakv_safeguard(c, 0.2) for c in (0, 1, 4, 5, 99)] == [0, 1, 1, 1, 19]
    assert adakv_safeguard(10, 0.0) == 0


@pytest.mark.parametrize("name, options, message", [
    ("ada", {}, "allocator='ada' is unknown; known: ['adakv', 'pyramidkv', 'uniform']"),
    ("adakv", {"alpha_safeguard": 1.5}, "alpha_safeguard=1.5 must lie in [0, 1]"),
    ("pyramidkv", {"beta": 0.5}, "beta=0.5 must be >= 1"),
])
def test_a_bad_allocator_fails_with_one_line(name, options, message):
    with pytest.raises(ValueError) as err:
        get_allocator(name, **options)
    assert str(err.value) == message


@pytest.mark.parametrize("design", [topk_design, poisson_design])
def test_ragged_heads_attend_over_their_own_kept_slots_only_and_count_their_bytes(design):
    """An AdaKV layer keeps a different count per KV head; the cache pads each head's row to the longest with
    log π = −inf. Attention over the derived layer equals, per head, a float64 softmax over that head's kept slots
    alone (with the Hájek offset −log π), and the kept bytes are the kept slots' (the padding is not counted)."""
    from kvcert.attention import compressed_attention
    from kvcert.cache import CompressedLayer
    from kvcert.generation import _footprint

    g = torch.Generator().manual_seed(5)
    d, group, m = 16, 2, 1
    keys, values = torch.randn(1, HEADS, N, d, generator=g), torch.randn(1, HEADS, N, d, generator=g)
    prefix = CompressedLayer()
    prefix.update(keys, values)
    (budget,) = AdaKV(alpha_safeguard=0.2).allocate(0.25, N, 1, OPTIONS.n_sink, OPTIONS.n_recent)
    sel = design(_scores()[:1], 0.25, OPTIONS, generator=torch.Generator().manual_seed(2), allocation=budget)
    kept = sel.retained[0]
    assert len(set(kept.tolist())) > 1  # ragged: the heads keep different counts
    layer = prefix.derive([sel], reserve=0)
    query = torch.randn(1, HEADS * group, m, d, generator=g)
    out = compressed_attention(layer, query, layer.keys, layer.values, 0.25, None)  # (1, hq, m, d)
    for h in range(HEADS):
        index = sel.index[0, h, : int(kept[h])]
        log_pi = sel.log_pi[0, h, : int(kept[h])].double()
        k, v = keys[0, h, index].double(), values[0, h, index].double()
        for q in range(group):
            logits = query[0, h * group + q, 0].double() @ k.T * 0.25 - log_pi
            reference = torch.softmax(logits, -1) @ v
            torch.testing.assert_close(out[0, h * group + q, 0].double(), reference, rtol=1e-5, atol=1e-5)

    class _State:  # what _footprint reads of a prefill: its cache's layers
        cache = type("C", (), {"layers": [prefix]})()

    _, padded, full, kept_bytes = _footprint(_State(), [sel])
    per_slot = full // N  # every head's slot of the layer: keys, values, log π, offset, positions
    assert kept_bytes * HEADS == int(kept.sum()) * per_slot
    assert padded == int(kept.max()) * per_slot and kept_bytes < padded

"""Design ``clt``: the peers' decode-time CLT-sized importance sampler run inside generation (kvcert.peer_sampling,
kvcert.designs.clt_design). The batched sampler against a float64 reference written from its definition; the
attention rows it replaces; generation on tiny random-weight models (GQA, sliding window, both settings); the
run schema's checks."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch
from helpers.tiny_models import build as _build
from helpers.tiny_models import prompt as _prompt

import kvcert
from kvcert.generation import Configuration, decode_configurations
from kvcert.peer_sampling import CLTOptions, DecodeSampler, clt_weights, exact_slots
from kvcert.targets import Target


def _rows(r=5, n=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(r, n, generator=g, dtype=torch.float64)
    allowed = torch.ones(r, n, dtype=torch.bool)
    allowed[1, 90:] = False  # a causal row
    allowed[2, :30] = False  # a windowed row
    exact = torch.zeros(r, n, dtype=torch.bool)
    exact[:, :4] = True
    exact[:, -16:] = True
    exact[3] = True  # nothing left to sample
    proposal = torch.rand(r, n, generator=g, dtype=torch.float64) + 0.05
    return logits, allowed, exact, proposal


def test_the_batched_sampler_is_its_definition_row_by_row():
    logits, allowed, exact, proposal = _rows()
    eps, delta, pilot = 0.08, 0.1, 20
    cap = torch.tensor([10_000, 10_000, 60, 10_000, 10_000])
    weights, sizes, moments, draws = clt_weights(logits, allowed, exact, proposal, epsilon=eps, delta=delta,
                                                 pilot=pilot, max_draws=cap, generator=torch.Generator().manual_seed(3))
    z = NormalDist().inv_cdf(1 - delta / 2)
    for row in range(logits.shape[0]):
        ok = allowed[row]
        kept = ok & exact[row]
        rest = ok & ~exact[row]
        w = torch.where(ok, torch.exp(logits[row] - logits[row][ok].max()), torch.zeros(()))
        if not rest.any():
            assert int(sizes[row]) == 0 and (draws[row] == -1).all()
            torch.testing.assert_close(weights[row], torch.where(kept, w, torch.zeros(())), rtol=1e-12, atol=0)
            continue
        s = torch.where(rest, proposal[row], torch.zeros(()))
        s = s / s.sum()
        m = int(sizes[row])
        drawn = draws[row][:m].tolist()
        assert (draws[row][m:] == -1).all() and all(bool(rest[i]) for i in drawn)
        x = [float(w[i] / s[i]) for i in drawn[:pilot]]
        mean, second = sum(x) / pilot, sum(v * v for v in x) / pilot
        bound = math.ceil(z * z * (second - mean * mean) / (eps ** 2 * mean ** 2))
        assert m == max(pilot, min(bound, int(cap[row]))), row
        assert moments[row].tolist() == pytest.approx([mean, second], rel=1e-12)
        expected = torch.where(kept, w, torch.zeros(()))
        for i in drawn:
            expected[i] += w[i] / (m * s[i])
        torch.testing.assert_close(weights[row], expected, rtol=1e-10, atol=1e-300)
    assert int(sizes[2]) == 60  # the cap binds on the row that asked for more


def test_the_ratio_estimate_converges_to_attention_as_the_target_tightens():
    """At a tight ε the output is attention; at a loose one it is further from it."""
    logits, allowed, exact, proposal = (t[:1] for t in _rows(n=300, seed=5))
    values = torch.randn(300, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full = torch.softmax(logits[0], -1) @ values
    errors = {}
    for eps in (0.2, 0.005):
        weights, _, _, _ = clt_weights(logits, allowed, exact, proposal, epsilon=eps, delta=0.05,
                                       generator=torch.Generator().manual_seed(0))
        out = (weights[0] @ values) / weights[0].sum()
        errors[eps] = float((out - full).norm() / full.norm())
    assert errors[0.005] < 0.05 and errors[0.005] < errors[0.2]


def test_exact_slots_are_sinks_window_and_top_logits_among_the_visible():
    logits = torch.tensor([[5.0, 0.0, 9.0, 1.0, 8.0, 0.5, 0.2, 7.0]])
    positions = torch.arange(8)[None]
    allowed = torch.tensor([[True, True, True, True, True, True, True, False]])
    exact = exact_slots(logits, positions, allowed, 6, n_sink=1, n_recent=2, n_top=2)
    # sink 0; window 5, 6 (query at 6); top-2 of the others visible: 2 (9.0), 4 (8.0); 7 is not visible
    assert exact[0].nonzero().flatten().tolist() == [0, 2, 4, 5, 6]


def test_rows_with_nothing_to_sample_are_exact_attention_with_gqa_and_a_causal_mask():
    hk, rows, slots, d = 2, 6, 20, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(hk, rows, d, generator=g), torch.randn(hk, slots, d, generator=g),
               torch.randn(hk, slots, d, generator=g))
    positions = torch.arange(slots).expand(hk, slots)
    q_pos = torch.tensor([17, 18, 19]).repeat(1, 2).expand(hk, rows)  # group 2 x m 3 rows per KV head
    allowed = positions.unsqueeze(1) <= q_pos.unsqueeze(-1)
    sampler = DecodeSampler(CLTOptions(0.1, 0.05, n_sink=4, n_recent=32), torch.rand(hk, 15, generator=g),
                            torch.Generator().manual_seed(0), context_tokens=15)
    out = sampler.attend(q, k, v, positions, allowed, q_pos, 0.3)
    logits = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
def test_generation_keeps_the_full_cache_measures_the_error_and_reproduces_its_seed(arch, setting):
    _, model, _ = _build(arch)
    context, question = _prompt(0, n_context=200)
    state = (kvcert.prefill(model, torch.cat([context, question], -1), setting=setting) if setting == "question_aware"
             else kvcert.prefill(model, context, question, setting=setting))
    confs = [Configuration("full", "full", 1.0, 0), Configuration("snapkv", "clt", 0.5, 1),
             Configuration("snapkv", "clt", 0.5, 2), Configuration("snapkv", "clt", 0.5, 1)]
    out = decode_configurations(model, state, confs, max_new_tokens=4, oracle=True, target=Target(0.1, 0.05))
    full, first, other, again = out
    for row in (first, other):
        assert row.kept_bytes == row.full_bytes == full.full_bytes  # nothing freed: the sample is redrawn per query
        assert len(row.steps) and row.steps["cert"].isna().all()  # no certificate: the peers' bound is on Σw
        assert np.isfinite(row.steps["true_err"]).all() and (row.steps["true_err"] > 0).any()
    assert first.token_ids == again.token_ids
    np.testing.assert_allclose(first.steps["true_err"], again.steps["true_err"], rtol=1e-6, atol=1e-7)
    assert not np.allclose(first.steps["true_err"], other.steps["true_err"])


def test_generation_with_nothing_to_sample_is_the_full_cache():
    """A context no longer than the sinks and the window: every slot is kept exactly, so clt decodes as full."""
    _, model, _ = _build("llama")
    context, question = _prompt(1, n_context=20)
    state = kvcert.prefill(model, torch.cat([context, question], -1))
    full, clt = decode_configurations(model, state, [Configuration("full", "full", 1.0, 0),
                                                     Configuration("snapkv", "clt", 0.5, 0)],
                                      max_new_tokens=5, oracle=True, target=Target(0.1, 0.05))
    assert clt.token_ids == full.token_ids
    assert float(clt.steps["true_err"].max()) < 1e-5


def test_clt_without_a_target_is_refused_in_one_line():
    _, model, _ = _build("llama")
    context, question = _prompt(1)
    state = kvcert.prefill(model, torch.cat([context, question], -1))
    with pytest.raises(ValueError, match="design='clt' samples at decode time against a target"):
        decode_configurations(model, state, [Configuration("snapkv", "clt", 0.5, 0)])
    with pytest.raises(ValueError, match="epsilon=0"):
        CLTOptions(0, 0.05)

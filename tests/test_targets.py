"""A budget as a target (kvcert.targets): the chosen expected sample size is the smallest one whose certificate,
predicted on the observation window's queries, meets ε — checked against a brute-force scan over sizes that
uses the design's own π (kvcert.sampling.inclusion_probabilities) and a loop written from the formula, in
float64; the prediction is the expectation of the realized tr V̂ on those queries (Monte Carlo); bad targets
get one line."""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from kvcert.designs import DesignOptions
from kvcert.estimator import hajek_attention
from kvcert.policies.base import LayerView
from kvcert.sampling import inclusion_probabilities, minimum_count, poisson_sample, retained_count
from kvcert.run_schema import DESIGN_ELIDED_AT_DEFAULT, ELIDED_AT_DEFAULT, HALF_CAP
from kvcert.targets import (CalibratedScale, Target, TargetNotMetWarning, check_target, choose_expected_counts,
                            row_inclusion_probabilities, target_design, window_terms)

OPTIONS = DesignOptions(n_sink=4, n_recent=16)


def _layer(n=240, hk=2, group=2, d=16, w=8, seed=0, sliding=None):
    g = torch.Generator().manual_seed(seed)
    keys = 2.0 * torch.randn(1, hk, n, d, generator=g, dtype=torch.float64)
    values = torch.randn(1, hk, n, d, generator=g, dtype=torch.float64) + 1.0
    queries = 2.0 * torch.randn(1, hk * group, w, d, generator=g, dtype=torch.float64)
    view = LayerView(keys, values, queries, None, d ** -0.5, sliding)
    scores = view.group_mean(view.window_attention().sum(2)).double()  # SnapKV-like: the window's attention
    return view, scores


def _window_attention(view: LayerView, head: int, qh: int, j: int):
    """(n,) float64 softmax of window query j of query head qh (of KV head ``head``), causally masked."""
    n, w = view.n, view.window_queries.shape[2]
    pos = n - w + j
    logits = view.keys[0, head] @ view.window_queries[0, qh, j] * view.scale
    allowed = torch.arange(n) <= pos
    if view.sliding_window is not None:
        allowed &= torch.arange(n) > pos - view.sliding_window
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), 0)


def _brute_prediction(view, pi, head, delta, scale=None):
    """max over window queries of sqrt(Σ_g Σ_i (1−π_i)/π_i a_i² ‖v_i − o‖² / δ) / ‖o_concat‖, by loops."""
    group, w = view.group_size, view.window_queries.shape[2]
    worst = 0.0
    for j in range(w):
        trace, norm_sq = 0.0, 0.0
        for g in range(group):
            a = _window_attention(view, head, head * group + g, j)
            o = a @ view.values[0, head]
            dist = (view.values[0, head] - o).square().sum(-1)
            term = a.square() * dist
            ratio = torch.where(pi > 0, (1 - pi) / pi, torch.full_like(pi, math.inf))
            trace += float(torch.where(term > 0, ratio * term, torch.zeros_like(term)).sum())
            norm_sq += float(o.square().sum())
        rel = math.sqrt(trace / delta) / math.sqrt(norm_sq)
        if scale is not None:
            rel = max(rel, scale.factor * (scale.cert_weight * rel + scale.norm_weight))
        worst = max(worst, rel)
    return worst


def _brute_force_count(view, scores, head, error, delta, budget, scale=None):
    n = view.n
    for m in range(minimum_count(n, OPTIONS.n_sink, OPTIONS.n_recent), retained_count(budget, n, 4, 16) + 1):
        pi = inclusion_probabilities(scores[0, head], m, n_sink=4, n_recent=16, head_fraction=OPTIONS.head_fraction,
                                     pi_min=OPTIONS.pi_min).double()
        if _brute_prediction(view, pi, head, delta, scale) <= error:
            return m
    return None


@pytest.mark.parametrize("counts", [[20, 21], [25, 90], [139, 200], [239, 240]])
@pytest.mark.parametrize("top_slice", [True, False])
def test_per_row_counts_give_the_designs_probabilities(counts, top_slice):
    _, scores = _layer()
    pi = row_inclusion_probabilities(scores, torch.tensor([counts]), OPTIONS, top_slice)
    for h, count in enumerate(counts):
        expected = inclusion_probabilities(scores[0, h], count, n_sink=4, n_recent=16,
                                           head_fraction=OPTIONS.head_fraction if top_slice else 0.0)
        torch.testing.assert_close(pi[0, h].float(), expected, rtol=0, atol=1e-7)
        assert abs(float(pi[0, h].sum()) - count) < 1e-6


@pytest.mark.parametrize("seed", range(6))
def test_targets_take_their_probabilities_from_sampling_and_equal_the_designs_on_random_inputs(seed):
    """kvcert.targets holds no inclusion probabilities of its own: its per-row π is kvcert.sampling's
    row_inclusion_probabilities under the design's options, and on random scores, counts, shares, floors and
    defenses each row equals what sampling's inclusion_probabilities gives that row at its count (the exact level
    against 100 bisection steps: within float32's rounding of π, Σπ the count)."""
    import kvcert.targets as targets_module
    from kvcert import sampling

    source = Path(targets_module.__file__).read_text()
    assert not hasattr(targets_module, "exact_water_fill")
    assert not any(f"def {name}(" in source for name in ("exact_water_fill", "_water_fill", "rank_scores", "mix_tail"))
    g = torch.Generator().manual_seed(seed)
    rows, n = 7, int(torch.randint(40, 300, (1,), generator=g))
    options = DesignOptions(n_sink=int(torch.randint(0, 6, (1,), generator=g)),
                            n_recent=int(torch.randint(1, 20, (1,), generator=g)),
                            head_fraction=float(torch.rand(1, generator=g)) * 0.5,
                            pi_min=float(torch.rand(1, generator=g)) * 0.05 + 1e-4,
                            tail_mix=[0.0, 0.3][seed % 2], head_attention_share=[0.0, 0.5, 1.0][seed % 3])
    scores = torch.rand(1, rows, n, generator=g, dtype=torch.float64) ** 3  # skewed: some tail π reach the cap
    attention = torch.rand(1, rows, n, generator=g, dtype=torch.float64)
    low = minimum_count(n, options.n_sink, options.n_recent)
    counts = torch.randint(low, n + 1, (1, rows), generator=g)
    pi = row_inclusion_probabilities(scores, counts, options, attention=attention)
    direct = sampling.row_inclusion_probabilities(
        scores, counts, n_sink=options.n_sink, n_recent=options.n_recent, head_fraction=options.head_fraction,
        pi_min=options.pi_min, tail_mix=options.tail_mix, head_attention_share=options.head_attention_share,
        attention=attention)
    assert torch.equal(pi, direct)
    for h in range(rows):
        expected = inclusion_probabilities(scores[0, h], int(counts[0, h]), n_sink=options.n_sink,
                                           n_recent=options.n_recent, head_fraction=options.head_fraction,
                                           pi_min=options.pi_min, tail_mix=options.tail_mix,
                                           head_attention_share=options.head_attention_share,
                                           attention=attention[0, h])
        torch.testing.assert_close(pi[0, h].float(), expected, rtol=0, atol=1e-6)
        assert abs(float(pi[0, h].sum()) - max(int(counts[0, h]), low)) < 1e-6


@pytest.mark.parametrize("error, sliding", [(0.3, None), (0.1, None), (0.05, 64)])
def test_the_choice_is_the_brute_force_smallest_size(error, sliding):
    view, scores = _layer(sliding=sliding)
    choice = choose_expected_counts(view, scores, Target(error, delta=0.05, floor=None), 0.9, OPTIONS)
    for h in range(2):
        expected = _brute_force_count(view, scores, h, error, 0.05, 0.9)
        assert expected is not None and minimum_count(240, 4, 16) < expected < choice.cap_count
        assert int(choice.expected_count[0, h]) == expected
        assert bool(choice.met[0, h]) and float(choice.predicted[0, h]) <= error
        pi = choice.pi[0, h].double()  # stored in float32, as the design's π is
        assert _brute_prediction(view, pi, h, 0.05) == pytest.approx(float(choice.predicted[0, h]), rel=1e-6)


@functools.cache
def _unfloored_brute_force_count(head: int) -> int | None:
    """The brute-force scan of _layer(seed=3)'s KV head ``head`` at ε 0.1, δ 0.05, cap 0.9, without a floor: the
    same for every floor below, so scanned once per session."""
    view, scores = _layer(seed=3)
    return _brute_force_count(view, scores, head, 0.1, 0.05, 0.9)


@pytest.mark.parametrize("floor", [0.05, 0.3, 0.5, 0.9])
def test_a_floor_raises_the_choice_to_it_and_changes_nothing_above_it(floor):
    """With a floor the choice is the smallest size >= retained_count(floor) whose prediction meets ε: by the
    brute-force scan, the larger of the floor's count and the unfloored choice (the prediction is monotone)."""
    view, scores = _layer(seed=3)
    free = choose_expected_counts(view, scores, Target(0.1, delta=0.05, floor=None), 0.9, OPTIONS)
    floored = choose_expected_counts(view, scores, Target(0.1, delta=0.05, floor=floor), 0.9, OPTIONS)
    floor_count = retained_count(floor, 240, 4, 16)
    for h in range(2):
        unfloored = _unfloored_brute_force_count(h)
        assert int(floored.expected_count[0, h]) == max(floor_count, unfloored)
        assert bool(floored.met[0, h])
    assert torch.equal(floored.expected_count, torch.maximum(free.expected_count, torch.tensor(floor_count)))
    # a floor at the cap keeps the cap everywhere, met or not
    at_cap = choose_expected_counts(view, scores, Target(1e-4, floor=0.9), 0.9, OPTIONS)
    assert torch.equal(at_cap.expected_count, torch.full((1, 2), retained_count(0.9, 240, 4, 16)))
    with pytest.raises(ValueError, match=r"^target_floor=0.95 exceeds the cap budget=0.9: the floor must not "
                                         r"exceed the cap$"):
        choose_expected_counts(view, scores, Target(0.1, floor=0.95), 0.9, OPTIONS)


def test_the_default_floor_is_half_the_cap():
    """Target's default floor is HALF_CAP: under the cap b it is the floor b/2, the same choice as an explicit
    target_floor of b/2, raising every head to that count; floor=None is the unfloored search."""
    assert Target(0.1).floor == HALF_CAP and Target(0.1).floor_at(0.5) == 0.25 and Target(0.1).floor_at(0.9) == 0.45
    assert Target(0.1, floor=None).floor_at(0.5) is None and Target(0.1, floor=0.3).floor_at(0.9) == 0.3
    view, scores = _layer(seed=3)
    default = choose_expected_counts(view, scores, Target(1.0, delta=0.05), 0.9, OPTIONS)
    explicit = choose_expected_counts(view, scores, Target(1.0, delta=0.05, floor=0.45), 0.9, OPTIONS)
    free = choose_expected_counts(view, scores, Target(1.0, delta=0.05, floor=None), 0.9, OPTIONS)
    assert torch.equal(default.expected_count, explicit.expected_count) and torch.equal(default.pi, explicit.pi)
    floor_count = retained_count(0.45, 240, 4, 16)
    assert torch.equal(default.expected_count, torch.maximum(free.expected_count, torch.tensor(floor_count)))
    assert bool((free.expected_count < floor_count).any())  # the floor binds here, so the default changes the choice


def test_the_calibrated_certificate_is_what_the_target_checks():
    """factor 2 on the paper certificate: meeting ε calibrated is meeting ε/2 uncalibrated."""
    view, scores = _layer(seed=1)
    doubled = choose_expected_counts(view, scores, Target(0.2, floor=None), 0.9, OPTIONS,
                                     calibration=CalibratedScale(2.0))
    halved = choose_expected_counts(view, scores, Target(0.1, floor=None), 0.9, OPTIONS)
    assert torch.equal(doubled.expected_count, halved.expected_count)
    with_norm = CalibratedScale(1.5, cert_weight=1.0, norm_weight=0.01)
    chosen = choose_expected_counts(view, scores, Target(0.2, floor=None), 0.9, OPTIONS, calibration=with_norm)
    assert int(chosen.expected_count[0, 0]) == _brute_force_count(view, scores, 0, 0.2, 0.05, 0.9, with_norm)


def test_the_cap_binds_and_says_so_and_an_easy_target_keeps_the_minimum():
    view, scores = _layer(seed=2)
    tight = choose_expected_counts(view, scores, Target(1e-4, floor=None), 0.25, OPTIONS)
    assert torch.equal(tight.expected_count, torch.full((1, 2), retained_count(0.25, 240, 4, 16)))
    assert not bool(tight.met.any())
    # at the sinks + recent window count the tail has π = 0: tokens the window attends to would be dropped with
    # no certificate (an unbounded prediction), so the smallest size that meets any target samples one more
    loose = choose_expected_counts(view, scores, Target(1e6, floor=None), 0.5, OPTIONS)
    assert torch.equal(loose.expected_count, torch.full((1, 2), 21)) and bool(loose.met.all())


def test_the_prediction_is_the_expected_realized_trace_on_the_observed_queries():
    """Drawing the chosen design many times and computing the realized certificate (kvcert.estimator) on the
    window's queries: per head and window query, the mean realized tr V̂ sits within 25% of the predicted one
    (the prediction is its first-order expectation)."""
    view, scores = _layer(n=400, seed=4)
    target = Target(0.1, floor=None)
    selection_pi = choose_expected_counts(view, scores, target, 0.9, OPTIONS).pi
    g = torch.Generator().manual_seed(0)
    group, w = view.group_size, view.window_queries.shape[2]
    log_pi = torch.log(selection_pi.double())
    traces, norms = [], []
    for _ in range(300):
        keep = poisson_sample(selection_pi, g)
        lp = torch.where(keep, log_pi, torch.full_like(log_pi, float("-inf")))
        # the window's queries see only the keys they observed: causal mask as -inf on log π
        q_pos = torch.arange(400 - w, 400).unsqueeze(-1)
        causal = torch.arange(400) <= q_pos  # (w, n)
        per_head = []
        for h in range(2):
            # batch (group, w): each window query is one row, its causal mask carried as log π = −inf
            rows = lp[0, h].expand(w, 400).masked_fill(~causal, float("-inf")).unsqueeze(0)  # (1, w, n)
            q = view.window_queries[0, h * group:(h + 1) * group].unsqueeze(-2)  # (group, w, 1, d)
            _, var = hajek_attention(q, view.keys[0, h][None, None], view.values[0, h][None, None], rows, view.scale)
            per_head.append(var.sum((0, 2, 3)))  # (w,): the trace over the group's query heads
        traces.append(torch.stack(per_head))
    mean_trace = torch.stack(traces).mean(0)  # (2, w)
    terms = window_terms(view)
    predicted = torch.einsum("hwn,hn->hw", terms.weights[0], (1 - selection_pi[0].double()) / selection_pi[0].double())
    ratio = mean_trace / predicted
    assert bool(((ratio > 0.75) & (ratio < 1.25)).all()), ratio


@pytest.mark.parametrize("args, message", [
    (("poisson", 0.0, None), "target_error=0.0: must be a number > 0"),
    (("poisson", -0.1, None), "target_error=-0.1: must be a number > 0"),
    (("poisson", 0.1, 1.0), r"target_delta=1.0: must lie in \(0, 1\)"),
    (("poisson", 0.1, 0.0), r"target_delta=0.0: must lie in \(0, 1\)"),
    (("topk", 0.1, None), "target_error=0.1 needs design 'poisson'.*got design 'topk'"),
    (("poisson", None, 0.1), "target_delta=0.1 is set but target_error is null"),
    (("poisson", 0.1, None, 0.0), r"target_floor=0.0: must lie in \(0, 1\] \(a fraction of the prefix\)"),
    (("poisson", 0.1, None, 1.5), r"target_floor=1.5: must lie in \(0, 1\]"),
    (("poisson", None, None, 0.25), "target_floor=0.25 is set but target_error is null: a floor is part of a target"),
    (("clt", 0.1, None, 0.25), "target_floor=0.25 applies to design 'poisson'.*design 'clt' keeps the whole cache"),
    (("poisson", 0.1, None, "half"), r"^target_floor='half': must lie in \(0, 1\] \(a fraction of the prefix\), or be "
                                     r"half_cap \(half the cap, the default\) or null \(no floor\)$"),
    (("poisson", 0.1, None, True), r"^target_floor=True: must lie in \(0, 1\]"),
])
def test_a_bad_target_gets_one_line(args, message):
    with pytest.raises(ValueError, match=message) as err:
        check_target(*args)
    assert "\n" not in str(err.value)


def test_the_default_floor_needs_no_target_and_leaves_clt_alone():
    # the default floor is no explicit floor: no refusal without a target, none for clt (which keeps every slot)
    assert check_target("poisson", None, None) is None and check_target("topk", None, None, HALF_CAP) is None
    assert check_target("clt", 0.1, None).floor == HALF_CAP
    assert check_target("poisson", 0.1, None, None).floor is None


def test_the_design_draws_at_the_chosen_probabilities():
    view, scores = _layer(seed=5)
    selection, choice = target_design(view, scores, Target(0.1), 0.9, OPTIONS, torch.Generator().manual_seed(3))
    kept_pi = selection.log_pi.exp()
    for h in range(2):
        valid = torch.isfinite(selection.log_pi[0, h])
        index = selection.index[0, h][valid]
        torch.testing.assert_close(kept_pi[0, h][valid], choice.pi[0, h][index])
        assert torch.equal(torch.sort(index).values, index)


def test_layers_searched_together_choose_and_draw_as_each_layer_alone():
    from kvcert.targets import targeted_selections

    layers = [_layer(seed=10 + i) for i in range(3)]
    views, scores = [v for v, _ in layers], [s for _, s in layers]
    scales = [CalibratedScale(1.5, 1.0, 0.01), None, CalibratedScale(2.0, 0.5, 0.0, never_below_paper=False)]
    selections, log = targeted_selections(views, scores, Target(0.1), 0.9, OPTIONS, seed=4, scales=scales)
    generator = torch.Generator().manual_seed(4)
    for i, (view, layer_scores) in enumerate(layers):
        alone, choice = target_design(view, layer_scores, Target(0.1), 0.9, OPTIONS, generator, True, scales[i])
        assert torch.equal(alone.index, selections[i].index) and torch.equal(alone.log_pi, selections[i].log_pi)
        rows = log[log["layer"] == i]
        assert rows["expected_count"].tolist() == choice.expected_count[0].tolist()
        assert rows["predicted_rel_cert"].tolist() == pytest.approx(choice.predicted[0].tolist(), rel=1e-12)


# --- end to end: generate(target_error=...) on a tiny random-weight Llama ---------------------------------------


def _tiny():
    from helpers.tiny_models import COMMON
    from helpers.tokenizer import byte_level_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})).eval()
    context = "the sky is blue. " * 30 + "the key is 4711. " + "grass is green. " * 30
    return model, tokenizer, dict(context=context, question="what is the key?", policy="snapkv", design="poisson",
                                  max_new_tokens=4, oracle=True)


def test_generate_with_a_target_keeps_the_chosen_sizes_and_logs_them(monkeypatch):
    import kvcert

    model, tokenizer, args = _tiny()
    # random weights attend almost uniformly: relative certificates are large, so the targets are too
    with warnings.catch_warnings():
        warnings.simplefilter("error", TargetNotMetWarning)  # every head meets these: no warning
        loose = kvcert.generate(model, tokenizer, **args, budget=1.0, target_error=1.0, target_floor=None)
        tight = kvcert.generate(model, tokenizer, **args, budget=1.0, target_error=0.2, target_delta=0.05,
                                target_floor=None)
    n_layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    n_pairs = n_layers * kv_heads
    with pytest.warns(TargetNotMetWarning, match=rf"target_error=0.2: {n_pairs} of {n_pairs} \(layer, KV head\) "
                                                 r"pairs .* at the cap budget=0.25 and keep the cap"):
        capped = kvcert.generate(model, tokenizer, **args, budget=0.25, target_error=0.2, target_floor=None)
    for result, error in ((loose, 1.0), (tight, 0.2), (capped, 0.2)):
        choice = result.target_choice
        assert len(choice) == n_layers * kv_heads and list(choice["layer"].unique()) == list(range(n_layers))
        assert (choice["expected_count"] <= choice["cap_count"]).all()
        assert (choice["predicted_rel_cert"][choice["met"]] <= error).all()
        assert (choice.loc[~choice["met"], "expected_count"] == choice.loc[~choice["met"], "cap_count"]).all()
        # the cache holds what was drawn at the chosen sizes, nothing of the cap beyond them
        assert result.retained_tokens == pytest.approx(choice["retained"].mean())
        assert not result.steps.empty and result.steps["true_err"].notna().all()
    assert loose.target_choice["met"].all() and tight.target_choice["met"].all()
    assert not capped.target_choice["met"].any()
    assert (loose.target_choice["expected_count"] < loose.target_choice["cap_count"]).all()
    assert (tight.target_choice["expected_count"] > loose.target_choice["expected_count"]).all()
    assert loose.retained_tokens < tight.retained_tokens
    # a floor: every head's size is at least its count, the loose target adding nothing above it
    with warnings.catch_warnings():
        warnings.simplefilter("error", TargetNotMetWarning)
        floored = kvcert.generate(model, tokenizer, **args, budget=1.0, target_error=1.0, target_floor=0.6)
    floor_count = retained_count(0.6, int(floored.target_choice["context_tokens"].iloc[0]))
    assert (floored.target_choice["expected_count"] == np.maximum(loose.target_choice["expected_count"],
                                                                  floor_count)).all()
    assert floored.retained_tokens > loose.retained_tokens
    # the default floor: half the budget, the same choice and draw as target_floor=budget/2
    with warnings.catch_warnings():
        warnings.simplefilter("error", TargetNotMetWarning)
        default = kvcert.generate(model, tokenizer, **args, budget=1.0, target_error=1.0)
        half = kvcert.generate(model, tokenizer, **args, budget=1.0, target_error=1.0, target_floor=0.5)
    assert default.target_choice.equals(half.target_choice) and default.retained_tokens == half.retained_tokens
    half_count = retained_count(0.5, int(default.target_choice["context_tokens"].iloc[0]))
    assert (default.target_choice["expected_count"] == np.maximum(loose.target_choice["expected_count"],
                                                                  half_count)).all()
    assert default.retained_tokens > loose.retained_tokens

    monkeypatch.setattr(kvcert.generation, "prefill", lambda *a, **k: pytest.fail("computed before refusing"))
    with pytest.raises(ValueError, match="needs design 'poisson'"):
        kvcert.generate(model, tokenizer, **{**args, "design": "topk"}, budget=0.5, target_error=0.1)
    with pytest.raises(ValueError, match="target_error=0.0: must be a number > 0"):
        kvcert.generate(model, tokenizer, **args, budget=0.5, target_error=0.0)
    with pytest.raises(ValueError, match=r"^target_floor=0.6 exceeds the cap budget=0.5"):
        kvcert.generate(model, tokenizer, **args, budget=0.5, target_error=0.1, target_floor=0.6)


@pytest.mark.filterwarnings("ignore::kvcert.targets.TargetNotMetWarning")  # the cap binds here; not what is tested
def test_generate_checks_the_target_against_the_calibrated_certificate():
    import kvcert
    from kvcert.calibration import design_knobs, fit_calibration, model_identity

    model, tokenizer, args = _tiny()
    plain = kvcert.generate(model, tokenizer, **args, budget=0.3)
    steps = pd.concat([plain.steps.assign(item_id=f"i{i}", policy="snapkv", design="poisson", budget=0.3, seed=0,
                                          setting="question_aware") for i in range(20)], ignore_index=True)
    cal = fit_calibration(steps, model=model_identity(model), design=design_knobs())
    paper = kvcert.generate(model, tokenizer, **args, budget=0.3, target_error=0.3)
    calibrated = kvcert.generate(model, tokenizer, **args, budget=0.3, target_error=0.3, calibration=cal)
    assert (calibrated.target_choice["expected_count"] >= paper.target_choice["expected_count"]).all()
    assert (calibrated.target_choice["predicted_rel_cert"] >= paper.target_choice["predicted_rel_cert"] - 1e-9).all()
    with pytest.raises(ValueError, match="fitted calibration file only"):
        kvcert.generate(model, tokenizer, **args, budget=0.3, target_error=0.3, calibration="design")


# --- the run schema and kvcert-run ------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["target_error=0"], "target_error=0.0: must be a number > 0"),
    (["target_error=0.1", "target_delta=1.5"], r"target_delta=1.5: must lie in (0, 1)"),
    (["target_error=0.1", "designs=[topk,poisson]"], "target_error=0.1 needs design 'poisson' (a Poisson sample of "
                                                      "the chosen size) or 'clt' (the decode-time sampler); got design "
                                                      "'topk'"),
    (["designs=[poisson,clt]"], "designs=[..., clt]: design clt samples at decode time against a target: set "
                                "target_error (and target_delta)"),
    (["target_delta=0.1"], "target_delta=0.1 is set but target_error is null: give both or neither"),
    (["target_error=0.1", "designs=[poisson]", "budgets=[0.25,0.5]", "target_floor=0.3"], "target_floor=0.3 exceeds "
     "budgets=[0.25]: the budget is the target's cap, and the floor must not exceed it"),
    (["target_floor=0.25"], "target_floor=0.25 is set but target_error is null: a floor is part of a target"),
    (["target_error=0.1", "designs=[poisson,clt]", "budgets=[0.5]", "target_floor=0.25"], "target_floor=0.25 "
     "applies to design 'poisson' (the sample chosen at prefill); design 'clt' keeps the whole cache"),
    (["target_error=0.1", "designs=[poisson]", "calibration=design"], "calibration='design': a target is checked "
     "against a fitted calibration file only (the data-free 'design' correction depends on the realized sample)"),    (["target_error=0.1", "designs=[poisson]", "allocator=adakv"], "allocator=adakv: a target chooses each KV "
     "head's sample size itself; drop target_error or the allocator"),
])
def test_a_bad_target_in_a_cell_config_fails_validation_with_one_line(overrides, message):
    from kvcert.errors import ConfigError
    from kvcert.hydra_app import compose
    from kvcert.runner.config import validate

    with pytest.raises(ConfigError) as err:
        validate(compose([*overrides, "out_dir=x"]))
    assert str(err.value) == message


def test_a_cell_without_a_target_keeps_its_identity_and_its_config_yaml():
    from omegaconf import OmegaConf

    from kvcert.hydra_app import compose
    from kvcert.runner.cell import _identity, config_yaml

    cfg = compose(["out_dir=x"])
    written = config_yaml(cfg)
    later = tuple(f"{key}:" for key in ELIDED_AT_DEFAULT)  # the keys added after committed cells (targets' among them)
    assert {"target_error:", "target_delta:", "target_floor:"} <= set(later)
    later += tuple(f"  {key}:" for key in DESIGN_ELIDED_AT_DEFAULT)  # design_options' later keys (the defenses)
    before = "".join(line for line in OmegaConf.to_yaml(cfg, resolve=True).splitlines(keepends=True)
                     if not line.startswith(later))
    assert written == before and "target" not in written
    assert not any(k.startswith("target") for k in _identity(cfg, [], "f")["config"])
    targeted = compose(["out_dir=x", "target_error=0.1", "designs=[poisson]"])
    assert _identity(targeted, [], "f")["config"]["target_error"] == 0.1
    assert "target_error: 0.1\n" in config_yaml(targeted)


def test_a_target_cell_has_the_floor_at_half_the_cap_unless_it_names_another():
    """kvcert-run's default floor is half_cap, written into config.yaml and the identity; target_floor=null is left
    out of both (as a cell written before the floor existed), and a config.yaml without the key reads back as
    null, what such a cell ran with."""
    import yaml

    from kvcert.hydra_app import compose
    from kvcert.runner.cell import _identity, config_yaml
    from kvcert.runner.config import validate

    base = ["out_dir=x", "target_error=0.1", "designs=[poisson]", "budgets=[0.25,0.5]"]
    default = compose(base)
    cell = validate(default)
    assert cell.target_floor == HALF_CAP
    assert [cell.target.floor_at(b) for b in cell.budgets] == [0.125, 0.25]
    assert "target_floor: half_cap\n" in config_yaml(default)
    assert _identity(default, [], "f")["config"]["target_floor"] == HALF_CAP
    unfloored = compose([*base, "target_floor=null"])
    written = config_yaml(unfloored)
    assert "target_floor" not in written and "target_floor" not in _identity(unfloored, [], "f")["config"]
    assert written == config_yaml(default).replace("target_floor: half_cap\n", "")
    read_back = validate(yaml.safe_load(written))
    assert read_back.target_floor is None and read_back.target.floor is None
    # the floor at half the cap of 0.5 is an explicit 0.25 there (the floored cells of the certified scales)
    assert validate(compose([*base[:3], "budgets=[0.5]", "target_floor=0.25"])).target.floor_at(0.5) == \
        validate(compose([*base[:3], "budgets=[0.5]"])).target.floor_at(0.5)


def test_kvcert_run_with_a_target_writes_the_choice_per_item_layer_and_head(tmp_path):
    """A target cell in process on a tiny Llama saved with save_pretrained and a two-item workload."""
    import yaml
    from helpers.tokenizer import byte_level_tokenizer
    from helpers.workload import write_workload

    from kvcert.hydra_app import compose
    from kvcert.runner.cell import run_cell

    model, tokenizer, _ = _tiny()
    directory = tmp_path / "tiny-llama"
    model.save_pretrained(directory)
    byte_level_tokenizer().save_pretrained(directory)
    path, records = write_workload(tmp_path / "items.jsonl")
    cfg = compose(["data=jsonl", f"data.path={path}", "model=hf", f"model.name={directory}", "policies=[snapkv]",
                   "designs=[poisson]", "budgets=[0.9]", "n_items=2", "threads=1", "progress=false",
                   "target_error=1.0", f"out_dir={tmp_path / 'cell'}"])
    out = run_cell(cfg, tmp_path / "cell")
    items = pd.read_parquet(out / "items.parquet")
    choices = pd.read_parquet(out / "targets.parquet")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    targeted = items[items["design"] == "poisson"]
    assert len(targeted) == 2 and len(choices) == 2 * layers * heads
    assert set(choices["item_id"]) == set(targeted["item_id"]) and (choices["budget"] == 0.9).all()
    for item_id, rows in choices.groupby("item_id"):
        retained = float(targeted.loc[targeted["item_id"] == item_id, "retained_tokens"].iloc[0])
        assert retained == pytest.approx(rows["retained"].mean())  # the cache holds what was chosen
        assert (rows["expected_count"] <= rows["cap_count"]).all()
    assert yaml.safe_load((out / "config.yaml").read_text())["target_error"] == 1.0


@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
def test_a_target_works_with_every_scorer(setting):
    """Every registered policy's scores feed the target (tiny random-weight Gemma 3: GQA, sliding-window layers):
    each configuration keeps per head the chosen expected size (its log names every layer and KV head), within
    the minimum and the cap, and decodes with its error measured; clt decodes beside it at the same target."""
    from helpers.tiny_models import build, prompt

    import kvcert
    from kvcert.generation import Configuration, decode_configurations
    from kvcert.policies import POLICIES, prefill_needs

    _, model, _ = build("gemma3")
    context, question = prompt(3, n_context=160)
    policies = sorted(POLICIES)
    needs = prefill_needs(policies, None)
    state = (kvcert.prefill(model, torch.cat([context, question], -1), setting=setting, **needs)
             if setting == "question_aware" else kvcert.prefill(model, context, question, setting=setting, **needs))
    confs = [Configuration(p, design, 0.5, 0) for p in policies for design in ("poisson", "clt")]
    out = decode_configurations(model, state, confs, max_new_tokens=3, oracle=True, target=Target(0.1, 0.05))
    layers, heads = len(state.cache.layers), state.cache.layers[0].keys.shape[1]
    for conf, decoded in zip(confs, out):
        assert len(decoded.steps) and decoded.steps["true_err"].notna().all(), conf
        if conf.design == "clt":
            assert decoded.target_choice is None and decoded.kept_bytes == decoded.full_bytes, conf
            continue
        choice = decoded.target_choice
        assert len(choice) == layers * heads, conf
        assert (choice["expected_count"] <= choice["cap_count"] + 1e-6).all(), conf
        assert decoded.kept_bytes < decoded.full_bytes, conf

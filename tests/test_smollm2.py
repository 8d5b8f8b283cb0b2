"""Monte-Carlo coverage of the certificate on real attention (SmolLM2-135M-Instruct, pass-key prompt).

Setting (fixed before measuring): a ~700–1000-token RULER-style pass-key prompt with four needles and the
question at the end; SnapKV scores from the last 16 prompt queries; the first decode step's queries (full
cache); every layer × KV head; 200 Poisson draws per budget. For each draw, ô and V̂ come from
``hajek_attention`` over the sampled prefix plus the new token (certain), o from plain softmax attention
over everything; per KV head the outputs of its query heads form one vector.

Acceptance windows, derived from the number of draws (draws are independent: each one's coverage over every
layer × KV head is one observation, and SE is their standard deviation over √draws; z = 3.29):

* bound coverage P(‖ô − o‖ ≤ √(tr V̂ / 0.05)) ≥ 0.95 − z·SE: Chebyshev guarantees 1 − δ = 0.95 when tr V̂ is
  the variance; false alarm ≤ 0.05% (one-sided) when it does;
* per-coordinate nominal-95% Wald coverage within 0.02 + z·SE of what an independent implementation of the
  estimator measured on a comparable SmolLM2 pass-key prompt (741 tokens, four needles, the same design):
  0.872 at 25% and 0.896 at 50%. Real attention is not where the normal approximation holds (heavy softmax
  weights in deep layers), so Wald under-covers; the 0.02 allows for the other prompt, and the false alarm
  is ≤ 0.1% within it. Nominal Wald coverage itself is tested where the approximation holds, through the
  decode path (``tests/test_certificate_calibration.py``);
* median relative error of Poisson+Hájek below uniform sampling at 25%.

The per-head retained sets of the decode path are checked against a float64 recomputation on this model in
``tests/test_reference_decoding.py``; here the estimator is driven directly, so that 200 draws stay cheap.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

import kvcert
from kvcert.designs import DesignOptions, topk_design
from kvcert.sampling import retained_count
from kvcert.theory import passkey_prompt

pytestmark = pytest.mark.smollm2

DRAWS = 200
DELTA = 0.05
Z95 = 1.959963984540054
Z = 3.290526731491926  # two-sided 0.1%, one-sided 0.05%
INDEPENDENT_WALD = {0.25: 0.872, 0.5: 0.896}  # an independent implementation, comparable prompt


@pytest.fixture(scope="module")
def first_step(smollm2):
    """Prefill of the prompt (for the scores) and of prompt + greedy token (for the first step's queries)."""
    model, tokenizer = smollm2
    context, question, _ = passkey_prompt(n_noise=32, n_needles=4, seed=1)
    ids = tokenizer(context + question, return_tensors="pt").input_ids
    n = ids.shape[-1]
    assert 700 <= n <= 1000, n
    state = kvcert.prefill(model, ids)
    token = int(state.last_logits.argmax())
    step = kvcert.prefill(model, torch.cat([ids, torch.tensor([[token]])], -1))
    return state, step


def _draws(step, layer, pi, generator, draws):
    """ô, V̂ over ``draws`` Poisson samples, and o; shapes (draws, kv_heads, group, d) and (kv_heads, group, d)."""
    lyr = step.cache.layers[layer]
    keys, values = lyr.keys[0].float(), lyr.values[0].float()  # (h, n + 1, d)
    h, _, d = keys.shape
    query = step.observations[layer].window_queries[0, :, -1, :].float()  # (q_heads, d): first decode step
    q = query.reshape(h, -1, d)  # (h, group, d)
    n = pi.shape[-1]
    keep = kvcert.poisson_sample(pi.expand(draws, h, n), generator)
    log_pi = torch.where(keep, torch.log(pi).expand(draws, h, n), torch.tensor(float("-inf")))
    log_pi = torch.cat([log_pi, torch.zeros(draws, h, 1)], -1)  # the new token: certain
    out, var = kvcert.hajek_attention(q[None], keys[None], values[None], log_pi, scale=step.observations[layer].scale)
    logits = torch.matmul(q.double(), keys.double().transpose(-1, -2)) * step.observations[layer].scale
    full = torch.softmax(logits, -1) @ values.double()
    return out.double(), var.double(), full


def _measure(state, step, policy, budget, seed, draws=DRAWS):
    """Per (layer, kv_head, draw): error norm, trace V̂, output norm, and per-coordinate Wald hits."""
    g = torch.Generator().manual_seed(seed)
    opts = DesignOptions()
    n = state.context_tokens
    count = retained_count(budget, n)
    head_fraction = opts.head_fraction if kvcert.POLICIES[policy].certain_top_slice else 0.0
    err, trace, norm, wald = [], [], [], []
    for layer, scores in enumerate(state.scores(policy)):
        pi = kvcert.inclusion_probabilities(scores[0], count, head_fraction=head_fraction)  # (h, n)
        out, var, full = _draws(step, layer, pi, g, draws)
        e = out - full
        err.append(e.square().sum((-1, -2)).sqrt())  # (draws, h)
        trace.append(var.sum((-1, -2)))
        norm.append(full.square().sum((-1, -2)).sqrt().expand_as(err[-1]))
        wald.append((e.abs() <= Z95 * var.sqrt()).double().mean((-1, -2)))
    return {k: torch.stack(v).numpy() for k, v in (("err", err), ("trace", trace), ("norm", norm), ("wald", wald))}


def _topk_rel_err(state, step, budget):
    """Median relative error of deterministic top-k (SnapKV scores; kept slots log π = 0, the rest −inf)."""
    rel = []
    for layer, scores in enumerate(state.scores("snapkv")):
        sel = topk_design(scores, budget, DesignOptions(), generator=torch.Generator().manual_seed(0))
        n = state.context_tokens
        keep = torch.zeros(scores.shape[1], n, dtype=torch.bool)
        keep.scatter_(-1, sel.index[0], True)
        lyr = step.cache.layers[layer]
        keys, values = lyr.keys[0].float(), lyr.values[0].float()
        h, _, d = keys.shape
        obs = step.observations[layer]
        q = obs.window_queries[0, :, -1, :].float().reshape(h, -1, d)
        log_pi = torch.cat([torch.where(keep, 0.0, float("-inf")), torch.zeros(h, 1)], -1)
        out, _ = kvcert.hajek_attention(q, keys, values, log_pi, scale=obs.scale)
        full = torch.softmax(torch.matmul(q.double(), keys.double().transpose(-1, -2)) * obs.scale, -1) @ values.double()
        rel.append(((out.double() - full).square().sum((-1, -2)).sqrt() / full.square().sum((-1, -2)).sqrt()))
    return float(torch.cat(rel).median())


def test_library_design_matches_the_measured_design(first_step):
    """The π used below are the ``poisson`` design's π: the selection's log π equals log π at its indices."""
    state, _ = first_step
    count = retained_count(0.25, state.context_tokens)
    selections = kvcert.select(state, "snapkv", "poisson", 0.25, seed=0)
    retained = []
    for scores, sel in zip(state.scores("snapkv"), selections):
        pi = kvcert.inclusion_probabilities(scores, count)
        valid = torch.isfinite(sel.log_pi)
        expect = torch.log(pi).gather(-1, sel.index)
        assert torch.equal(sel.log_pi[valid], expect[valid])
        retained.append(sel.retained.float())
    mean = float(torch.cat(retained).mean())
    # Σπ = count per KV head: the mean retained count over the layers × KV heads has a standard error at most
    # sqrt(count / n_heads) (Poisson variance Σπ(1 − π) ≤ Σπ), about 1.5 for 90 heads at ~210 tokens: 5% is > 6 of them
    assert abs(mean - count) < 0.05 * count


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_certificate_and_wald_coverage_on_real_attention(first_step, budget):
    state, step = first_step
    m = _measure(state, step, "snapkv", budget, seed=11)
    cert = np.sqrt(m["trace"] / DELTA)
    bound_cov = float((m["err"] <= cert).mean())
    bound_196 = float((m["err"] <= 1.96 * np.sqrt(m["trace"])).mean())
    wald_cov = float(m["wald"].mean())
    rel = m["err"] / m["norm"]
    rho = spearmanr(np.sqrt(m["trace"]).ravel(), m["err"].ravel()).statistic
    print(
        f"\n[budget {budget}] n={state.context_tokens} layers×heads×draws={m['err'].size}: "
        f"bound coverage {bound_cov:.3f}, ‖e‖≤1.96√trV̂ {bound_196:.3f}, Wald coverage {wald_cov:.3f}, "
        f"median rel. error {np.median(rel):.4f}, Spearman(√trV̂, ‖e‖) {rho:.3f}"
    )
    per_draw_bound = (m["err"] <= cert).mean(axis=(0, 2))  # (draws,): m[...] is (layers, draws, kv_heads)
    per_draw_wald = m["wald"].mean(axis=(0, 2))
    se_bound = per_draw_bound.std(ddof=1) / math.sqrt(DRAWS)
    se_wald = per_draw_wald.std(ddof=1) / math.sqrt(DRAWS)
    assert bound_cov >= 1 - DELTA - Z * se_bound, (bound_cov, se_bound)
    assert abs(wald_cov - INDEPENDENT_WALD[budget]) <= 0.02 + Z * se_wald, (wald_cov, se_wald)


def test_poisson_beats_uniform_at_quarter_budget(first_step):
    state, step = first_step
    poisson = _measure(state, step, "snapkv", 0.25, seed=12, draws=50)
    uniform = _measure(state, step, "uniform", 0.25, seed=13, draws=50)
    med_p = float(np.median(poisson["err"] / poisson["norm"]))
    med_u = float(np.median(uniform["err"] / uniform["norm"]))
    med_t = _topk_rel_err(state, step, 0.25)
    print(f"\n[budget 0.25] median rel. error: poisson {med_p:.4f} / topk {med_t:.4f} / uniform {med_u:.4f}")
    assert med_p < med_u


def test_generate_end_to_end(smollm2):
    """One short pass-key item: full cache and compressed configurations, with certificate columns."""
    model, tokenizer = smollm2
    context, question, answer = passkey_prompt(n_noise=10, n_needles=1, seed=3)
    full = kvcert.generate(model, tokenizer, context=context, question=question, policy="full", max_new_tokens=7)
    assert answer in full.text
    assert len(full.steps) == 0
    for setting in ("question_aware", "streaming"):
        res = kvcert.generate(
            model, tokenizer, context=context, question=question, policy="snapkv", design="poisson",
            budget=0.5, setting=setting, seed=1, oracle=True, max_new_tokens=4,
        )
        steps = res.steps
        assert list(steps.columns) == [
            "step", "layer", "kv_head", "trace_var", "cert", "true_err", "rel_cert", "rel_err", "coverage", "wald_coverage",
            "tail_ess", "out_norm",
        ]
        n_layers = model.config.num_hidden_layers
        n_kv = model.config.num_key_value_heads
        n_steps = len(res.token_ids) - 1 + (0 if setting == "question_aware" else len(tokenizer(question, add_special_tokens=False).input_ids))
        assert len(steps) == n_steps * n_layers * n_kv
        assert steps[["trace_var", "cert", "true_err", "coverage"]].notna().all().all()
        # Each row's certificate is √(tr V̂ / δ) of its trace at the default δ, its coverage whether the true error
        # lies within it, and the relative columns those over ‖ô‖.
        from kvcert.run_schema import DELTA

        np.testing.assert_allclose(steps["cert"], np.sqrt(steps["trace_var"] / DELTA), rtol=1e-12)
        assert (steps["coverage"] == (steps["true_err"] <= steps["cert"]).astype(float)).all()
        np.testing.assert_allclose(steps[["rel_cert", "rel_err"]].to_numpy(),
                                   steps[["cert", "true_err"]].to_numpy() / steps[["out_norm"]].to_numpy(), rtol=1e-12)
        # Chebyshev's 1 − δ = 0.95 holds on average; rows of one item's few steps move together, hence 0.8
        assert float(steps["coverage"].mean()) >= 0.8
        assert res.cache_bytes / res.full_bytes <= 0.5 + 0.03  # the budget + 0.03 the overhead benchmark targets
        assert math.isfinite(sum(res.logprobs))


@pytest.mark.slow  # make test-full: a benchmark script end to end (seconds of decoding)
def test_certificate_overhead_benchmark_runs(capsys):
    """The benchmark script end to end on a short context (its timings are printed, never asserted)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "certificate_overhead.py"
    spec = importlib.util.spec_from_file_location("certificate_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--contexts", "300", "--reps", "2", "--new-tokens", "3", "--threads", "1"]) == 0
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(table) == 1
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    # columns: context, ms/step of each configuration, four ratios (d/c, d/c passes only, e/c, f/c), two byte ratios
    assert len(cells) == 1 + len(module.CONFIGS) + 4 + 2
    # bytes are a property of the cache, not of timing: top-k holds exactly the budget (--budget's default, 0.25),
    # Poisson the budget in expectation (its count's sd over ~300 tokens: sqrt(75)/300 = 0.03 per head)
    assert abs(float(cells[-2]) - 0.25) < 0.01 and 0.2 < float(cells[-1]) < 0.35


@pytest.mark.slow  # make test-full: a benchmark script end to end (seconds of decoding)
def test_certificate_overhead_parts_benchmark_runs(capsys, monkeypatch):
    """The PyTorch-path breakdown end to end on a short context: one row of four ratios, every configuration
    decoding the same tokens (the script asserts it), and the library's functions restored afterwards (its
    timings are printed, never asserted)."""
    import importlib.util
    import os

    import kvcert.attention
    from kvcert.certificates import CertificateRecorder
    from kvcert.estimator import hajek_with_variance

    recorder_add = CertificateRecorder.add
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    path = benchmarks / "certificate_overhead_parts.py"
    spec = importlib.util.spec_from_file_location("certificate_overhead_parts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernels_setting = os.environ.get("KVCERT_KERNELS")
    assert module.main(["--contexts", "300", "--reps", "2", "--new-tokens", "3", "--threads", "1"]) == 0
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(table) == 1
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    assert len(cells) == 2 + 4 and all(float(c.split()[0]) > 0 for c in cells[1:])
    assert kvcert.attention.hajek_with_variance is hajek_with_variance
    assert CertificateRecorder.add is recorder_add
    assert os.environ.get("KVCERT_KERNELS") == kernels_setting


@pytest.mark.slow  # make test-full: an exploratory script end to end (two items generated and decoded)
def test_task_probe_runs_and_scores_like_the_runner(tmp_path, capsys):
    """The exploratory task probe end to end: one small item per variant, a CSV row each, and its accuracy the
    share that kvcert.data's scoring calls correct (checked against the answer it records)."""
    import importlib.util
    import json

    import pandas as pd

    from kvcert.data import is_correct, load_items, score_item
    from kvcert.models import load_tokenizer

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "task_probe.py"
    spec = importlib.util.spec_from_file_location("task_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    variants = [{"name": "vt", "num_hops": 1, "example_words": 60, "context_tokens": 300, "max_new_tokens": 8},
                {"name": "fwe", "context_tokens": 256, "max_new_tokens": 8}]
    out = tmp_path / "probe.csv"
    assert module.main(["--seed", "12345", "--items", "1", "--tasks", json.dumps(variants), "--out", str(out)]) == 0
    table = pd.read_csv(out, keep_default_na=False)
    assert list(table["task"]) == ["vt_1", "fwe"] and list(table["n_items"]) == [1, 1]
    tokenizer = load_tokenizer("smollm2")
    for row, variant in zip(table.itertuples(), variants):
        (item,) = load_items("ruler", {"name": "ruler", "tasks": [variant], "seed": 12345}, tokenizer, 1)
        assert row.first_reference == " ".join(item.answers) and json.loads(row.variant) == variant
        assert row.n_correct == int(is_correct(score_item(item, row.first_answer), item.metric))
    assert "first_answer" in capsys.readouterr().out

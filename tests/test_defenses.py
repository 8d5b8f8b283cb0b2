"""The certificate's two defenses (issue 60's designs), design poisson only, both 0 by default:

* ``design_options.tail_mix`` (λ): the tail's inclusion probabilities mixed with a uniform share at the same
  expected count, so that every tail π is at least λ·(tail count)/(tail size);
* ``design_options.head_attention_share`` (η): a share of the certain head's top slice given to the tokens the
  observation window's queries attend to most, the rest to the scorer's top, at the same count.

Most tests need no model: π against an independent float64 reference written here (numpy, sorting and bisection,
no kvcert code), the Hájek estimator and its certificate against the textbook formulas in float64. The
SmolLM2 test runs kvcert-run on three one-item cells (about 30 s on 2 cores: marked slow).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import kvcert
from kvcert.allocators import LayerBudget
from kvcert.designs import poisson_design, topk_design, window_attention_mass
from kvcert.errors import ConfigError
from kvcert.estimator import certificate, hajek_attention
from kvcert.hydra_app import compose
from kvcert.policies.base import LayerView
from kvcert.run_schema import DESIGN, DesignOptions, elide_defaults
from kvcert.runner.cell import _identity, config_yaml
from kvcert.runner.config import validate
from kvcert.sampling import inclusion_probabilities
from kvcert.targets import Target, choose_expected_counts, row_inclusion_probabilities

GRID = [0.0, 0.5, 1.0]
N, COUNT = 240, 80  # 36 certain (4 sinks + 32 recent), a top slice of int(0.5 * 44) = 22, a tail of 182


def _rows(rows: int, n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Heavy-tailed scores (so that the cap at 1 binds) and an unrelated attention, (rows, n) float64, no ties."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.exp(3.0 * torch.randn(rows, n, generator=g, dtype=torch.float64))
    attention = torch.softmax(2.0 * torch.randn(rows, n, generator=g, dtype=torch.float64), -1)
    return scores, attention


def reference_pi(scores: np.ndarray, attention: np.ndarray, count: float, lam: float, eta: float,
                 n_sink: int = DESIGN.n_sink, n_recent: int = DESIGN.n_recent,
                 head_fraction: float = DESIGN.head_fraction, pi_min: float = DESIGN.pi_min) -> np.ndarray:
    """The defended design's π of one row, float64, from its definition: sinks and recent window certain; a top
    slice of int(head_fraction · (count − certain)) tokens, int(η · slice) by attention, the rest by score among
    those not chosen; the tail π = clip(c·score, pi_min, 1) with Σ = the tail's share (c by bisection on log c),
    then (1 − λ)·π + λ·share/|tail|."""
    n = len(scores)
    head = np.zeros(n, bool)
    head[:n_sink] = True
    head[n - n_recent:] = True
    n_certain = int(head.sum())
    n_top = int(head_fraction * (count - n_certain))
    n_attended = int(eta * n_top)
    free = np.flatnonzero(~head)
    head[free[np.argsort(-attention[free], kind="stable")][:n_attended]] = True
    rest = np.flatnonzero(~head)
    head[rest[np.argsort(-scores[rest], kind="stable")][:n_top - n_attended]] = True
    tail = np.flatnonzero(~head)
    share = count - n_certain - n_top
    s = scores[tail]
    if pi_min * len(tail) >= share:
        p = np.full(len(tail), share / len(tail))
    else:
        lo, hi = math.log(pi_min / s.max()) - 1.0, math.log(1.0 / s.min()) + 1.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if np.clip(math.exp(mid) * s, pi_min, 1.0).sum() < share else (lo, mid)
        p = np.clip(math.exp(hi) * s, pi_min, 1.0)
    p = (1.0 - lam) * p + lam * share / len(tail)
    pi = np.ones(n)
    pi[tail] = p
    return pi


# ------------------------------------------------------------------------------------------- π


@pytest.mark.parametrize("lam", GRID)
@pytest.mark.parametrize("eta", GRID)
def test_pi_equals_the_float64_reference_keeps_the_expected_count_and_the_head(lam, eta):
    scores, attention = _rows(3)
    pi = inclusion_probabilities(scores, COUNT, tail_mix=lam, head_attention_share=eta, attention=attention)
    plain = inclusion_probabilities(scores, COUNT)
    for row in range(3):
        ref = reference_pi(scores[row].numpy(), attention[row].numpy(), COUNT, lam, eta)
        np.testing.assert_allclose(pi[row].double().numpy(), ref, rtol=2e-6, atol=1e-7)
    assert pi.dtype == torch.float32 and bool((pi <= 1).all()) and bool((pi > 0).all())
    torch.testing.assert_close(pi.double().sum(-1), torch.full((3,), float(COUNT), dtype=torch.float64),
                               rtol=0, atol=1e-3)
    # the certain head keeps its count (36 certain + a top slice of 22); a tail token the cap held at 1 falls
    # below it under the mix
    head = 36 + 22
    assert ((pi == 1).sum(-1) >= head).all() and ((plain == 1).sum(-1) > head).any()
    if lam == 1:
        assert ((pi == 1).sum(-1) == head).all()
    if lam == 0 and eta == 0:
        assert torch.equal(pi, plain)  # today's design, bit for bit


@pytest.mark.parametrize("lam", [0.2, 0.5, 1.0])
def test_every_tail_pi_is_at_least_lambda_times_the_tail_count_over_its_size(lam):
    scores, attention = _rows(4, seed=1)
    pi = inclusion_probabilities(scores, COUNT, tail_mix=lam).double()
    plain = inclusion_probabilities(scores, COUNT).double()
    # the tail: neither sinks, recent window nor the top slice of 22 by score (capped tokens of it have π = 1)
    tail = torch.zeros_like(pi, dtype=torch.bool)
    tail[:, DESIGN.n_sink:N - DESIGN.n_recent] = True
    ranked = torch.where(tail, scores, torch.full_like(scores, -1.0))
    tail.scatter_(-1, torch.topk(ranked, 22, dim=-1).indices, False)
    size = tail.sum(-1, keepdim=True).double()
    share = (plain * tail).sum(-1, keepdim=True)  # the tail's expected count
    torch.testing.assert_close(share, torch.full_like(share, COUNT - 36 - 22.0), rtol=0, atol=1e-4)
    floor = lam * share / size
    assert bool((pi[tail] >= (floor.expand_as(pi)[tail] - 1e-7)).all())
    assert float(plain[tail].min()) < float(floor.min())  # the scorer alone falls below it
    if lam == 1.0:  # a fully uniform tail
        torch.testing.assert_close(pi[tail], floor.expand_as(pi)[tail], rtol=0, atol=1e-7)
    # capped (π = 1 in the scorer's tail) tokens stay at most 1
    assert bool((pi <= 1 + 1e-7).all())


def _head(pi: torch.Tensor, n_sink: int = DESIGN.n_sink, n_recent: int = DESIGN.n_recent) -> set[int]:
    """Positions of the top slice: π = 1 beyond the sinks and the recent window."""
    n = pi.shape[-1]
    return {i for i in torch.nonzero(pi == 1).flatten().tolist() if n_sink <= i < n - n_recent}


@pytest.mark.parametrize("eta, attended", [(0.0, 0), (0.5, 11), (1.0, 22)])
def test_the_head_takes_the_attentions_top_first_then_the_scores_top_without_counting_twice(eta, attended):
    n, count = N, COUNT  # a top slice of 22
    free = list(range(4, n - 32))
    scores = torch.zeros(n, dtype=torch.float64)
    scores[free] = torch.linspace(0.1, 1.0, len(free), dtype=torch.float64)  # the scores rank the last first
    attention = torch.zeros(n, dtype=torch.float64)
    attention[free] = torch.linspace(1.0, 0.1, len(free), dtype=torch.float64)  # the attention the first first
    pi = inclusion_probabilities(scores, count, head_attention_share=eta, attention=attention)
    by_attention, by_score = set(free[:attended]), set(free[len(free) - (22 - attended):])
    assert _head(pi) == by_attention | by_score and len(_head(pi)) == 22

    # where the two rankings agree, the scores fill from the next token on: 22 tokens, none twice
    agreeing = inclusion_probabilities(scores, count, head_attention_share=eta, attention=scores.clone())
    assert _head(agreeing) == set(free[-22:])
    torch.testing.assert_close(agreeing, inclusion_probabilities(scores, count))


def test_pooled_allocation_and_targets_take_both_defenses():
    scores, attention = _rows(2 * 3, seed=2)
    scores, attention = scores.view(2, 3, N).float(), attention.view(2, 3, N).float()
    options = DesignOptions(tail_mix=0.5, head_attention_share=0.5)
    pooled = LayerBudget(COUNT, pooled=True, safeguard=8)
    selection = poisson_design(scores, 0.3, options, torch.Generator().manual_seed(0), allocation=pooled,
                               attention=attention)
    assert selection.has_tail
    with pytest.raises(ValueError, match=r"head_attention_share=0.5 needs the window's attention"):
        poisson_design(scores, 0.3, options, torch.Generator().manual_seed(0), allocation=pooled)

    # targets: the row-wise π at several counts is inclusion_probabilities' row by row, defenses included
    counts = torch.tensor([[50, 80, 120], [40, 100, 239]])
    rows = row_inclusion_probabilities(scores.double(), counts, options, attention=attention.double())
    for b in range(2):
        for h in range(3):
            one = inclusion_probabilities(scores[b, h].double(), int(counts[b, h]), tail_mix=0.5,
                                          head_attention_share=0.5, attention=attention[b, h].double())
            torch.testing.assert_close(rows[b, h], one.double(), rtol=0, atol=1e-6)


def _view(seed: int = 3, n: int = 160) -> LayerView:
    g = torch.Generator().manual_seed(seed)
    return LayerView(keys=torch.randn(1, 2, n, 16, generator=g), values=torch.randn(1, 2, n, 16, generator=g),
                     window_queries=3 * torch.randn(1, 4, 16, 16, generator=g), accumulated_attention=None,
                     scale=0.25)


def test_a_target_chooses_its_count_under_the_defenses_and_the_head_follows_the_windows_attention():
    view = _view()
    scores = torch.rand(1, 2, view.n, generator=torch.Generator().manual_seed(4))
    target = Target(error=0.3, floor=None)
    plain = choose_expected_counts(view, scores, target, 0.5)
    options = DesignOptions(tail_mix=0.5, head_attention_share=1.0)
    defended = choose_expected_counts(view, scores, target, 0.5, options)
    torch.testing.assert_close(defended.pi.double().sum(-1), defended.expected_count.double(), rtol=0, atol=1e-3)
    mass = window_attention_mass(view)  # (1, 2, n): SnapKV's window attention before its pooling
    assert mass.shape == scores.shape
    torch.testing.assert_close(mass.sum(-1), torch.ones(1, 2))
    for h in range(2):  # η = 1: the whole top slice is the window's most attended non-certain tokens
        top = _head(defended.pi[0, h])
        free = torch.arange(DESIGN.n_sink, view.n - DESIGN.n_recent)
        expected = set(free[torch.argsort(-mass[0, h, free].double(), stable=True)[:len(top)]].tolist())
        assert top == expected and len(top) > 0
    assert not torch.equal(defended.pi, plain.pi)


def test_decode_time_compression_takes_the_heads_window_attention():
    from kvcert.decode_compression import thin_head
    from kvcert.policies import get_policy

    view = _view(seed=8, n=200)
    head = LayerView(keys=view.keys[:, :1], values=view.values[:, :1], window_queries=view.window_queries[:, :2],
                     accumulated_attention=None, scale=view.scale)
    log_pi = torch.zeros(200)
    options = DesignOptions(tail_mix=0.5, head_attention_share=1.0)
    kept, stage = thin_head(head, log_pi, 100, policy=get_policy("snapkv"), design="poisson", options=options,
                            generator=torch.Generator().manual_seed(0))
    certain = set(kept[stage == 0].tolist()) - set(range(DESIGN.n_sink)) - set(range(200 - DESIGN.n_recent, 200))
    mass = window_attention_mass(head)[0, 0]
    free = torch.arange(DESIGN.n_sink, 200 - DESIGN.n_recent)
    top = free[torch.argsort(-mass[free].double(), stable=True)[:len(certain)]]
    assert certain == set(top.tolist()) and len(certain) == int(0.5 * (100 - 36))


# ------------------------------------------------------------------------------------------- the estimator


def _reference_estimate(q, k, v, keep, pi, scale, delta):
    """The Hájek estimate and its certificate sqrt(Σ_S (1 − π) a² ‖v − ô‖² / δ), float64 numpy, per query."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    idx = np.flatnonzero(keep)
    logits = q @ k[idx].T * scale  # (m, |S|)
    w = np.exp(logits - logits.max(-1, keepdims=True)) / pi[idx]
    a = w / w.sum(-1, keepdims=True)
    out = a @ v[idx]
    var = ((1 - pi[idx]) * a ** 2 * ((v[idx][None, :, :] - out[:, None, :]) ** 2).sum(-1)).sum(-1)
    return out, np.sqrt(var / delta)


@pytest.mark.parametrize("lam", GRID)
@pytest.mark.parametrize("eta", GRID)
def test_hajek_estimate_and_certificate_equal_the_float64_reference(lam, eta):
    g = torch.Generator().manual_seed(5)
    n, d, m = N, 16, 3
    k, v, q = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), 2 * torch.randn(m, d, generator=g)
    scores, attention = _rows(1, seed=6)
    options = DesignOptions(tail_mix=lam, head_attention_share=eta)
    selection = poisson_design(scores.view(1, 1, n).float(), COUNT / n, options,
                               torch.Generator().manual_seed(7), attention=attention.view(1, 1, n).float())
    index, log_pi = selection.index[0, 0], selection.log_pi[0, 0]
    pi = reference_pi(scores[0].numpy(), attention[0].numpy(), COUNT, lam, eta)
    keep = np.zeros(n, bool)
    keep[index.numpy()] = True
    np.testing.assert_allclose(np.exp(log_pi.double().numpy()), pi[index.numpy()], rtol=2e-6)
    scale = 1 / math.sqrt(d)
    out, var = hajek_attention(q.view(1, m, d), k[index].view(1, -1, d), v[index].view(1, -1, d),
                               log_pi.view(1, -1), scale)
    cert = certificate(var.sum(-1), 0.05)
    ref_out, ref_cert = _reference_estimate(q.numpy(), k.numpy(), v.numpy(), keep, pi, scale, 0.05)
    np.testing.assert_allclose(out[0].double().numpy(), ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cert[0].double().numpy(), ref_cert, rtol=1e-4, atol=1e-6)
    assert float(cert.min()) > 0  # a sampled tail: a certificate to compare


# ------------------------------------------------------------------------------------------- refusals, config


@pytest.mark.parametrize("name, value", [("tail_mix", 1.5), ("tail_mix", -0.1), ("head_attention_share", 2.0)])
def test_a_value_outside_0_1_is_refused_in_one_line_naming_the_option(name, value):
    line = rf"^design_options\.{name}={value}: must lie in \[0, 1\]$"
    with pytest.raises(ConfigError, match=line):
        validate(compose(["out_dir=x", "designs=[poisson]", f"design_options.{name}={value}"]))
    scores = torch.rand(1, 2, 100)
    with pytest.raises(ValueError, match=rf"^design_options\.{name}={value!r} must lie in \[0, 1\]$"):
        inclusion_probabilities(scores, 50, **{name: value})
    with pytest.raises(ValueError, match=rf"^kvcert\.press: design_options\.{name}={value!r} must lie in"):
        kvcert.press(policy="snapkv", design="poisson", budget=0.5, options=DesignOptions(**{name: value}))


@pytest.mark.parametrize("name", ["tail_mix", "head_attention_share"])
def test_either_defense_with_design_topk_is_refused_in_one_line(name):
    with pytest.raises(ConfigError, match=rf"^designs: design_options\.{name}=0\.3 applies to design 'poisson'"):
        validate(compose(["out_dir=x", f"design_options.{name}=0.3"]))  # designs [topk, poisson] by default
    options = DesignOptions(**{name: 0.3})
    with pytest.raises(ValueError, match=rf"^kvcert: design_options\.{name}=0\.3 applies to design 'poisson'.*"
                                         r"design 'topk' has none"):
        topk_design(torch.rand(1, 2, 100), 0.5, options)
    with pytest.raises(ValueError, match=rf"^kvcert\.press: design_options\.{name}=0\.3"):
        kvcert.press(policy="snapkv", design="topk", budget=0.5, options=options)
    kvcert.press(policy="snapkv", design="poisson", budget=0.5, options=options)  # accepted


def test_at_zero_the_options_are_absent_from_config_identity_and_calibration_and_named_when_on():
    from kvcert.calibration import design_knobs
    from kvcert.calibration.fileformat import Calibration
    from kvcert.errors import CalibrationError

    off, zero = compose(["out_dir=x"]), compose(["out_dir=x", "design_options.tail_mix=0",
                                                 "design_options.head_attention_share=0.0"])
    on = compose(["out_dir=x", "designs=[poisson]", "design_options.tail_mix=0.2",
                  "design_options.head_attention_share=0.5"])
    assert config_yaml(zero) == config_yaml(off) and "tail_mix" not in config_yaml(off)
    assert _identity(zero, [], "f") == _identity(off, [], "f")
    saved = yaml.safe_load(config_yaml(on))["design_options"]
    assert saved["tail_mix"] == 0.2 and saved["head_attention_share"] == 0.5
    assert validate({**yaml.safe_load(config_yaml(on)), "out_dir": "x"}).options == DesignOptions(
        tail_mix=0.2, head_attention_share=0.5)  # read back
    assert elide_defaults({"design_options": {"n_sink": 4, "tail_mix": 0.0}}) == {"design_options": {"n_sink": 4}}

    # a calibration file records the knobs only away from 0; a file without them was fitted at 0
    assert "tail_mix" not in design_knobs() and design_knobs(DesignOptions(tail_mix=0.2))["tail_mix"] == 0.2
    file = Calibration(method="conformal", level=0.99, base="paper", unit="row", model={}, design=design_knobs())
    file.check_design(design_knobs())
    with pytest.raises(CalibrationError, match=r"design_options\.tail_mix=0\.2 here but 0\.0 in the file"):
        file.check_design(design_knobs(DesignOptions(tail_mix=0.2)))


# ------------------------------------------------------------------------------------------- SmolLM2, end to end


def _cell(tmp_path, name: str, *extra: str) -> tuple[int, object]:
    from kvcert.runner import cli
    from kvcert.theory import passkey_prompt

    context, question, answer = passkey_prompt(n_noise=10, n_needles=2, seed=11)
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps({"id": "defenses/0", "context": context, "question": question,
                                "answers": [answer], "max_new_tokens": 4}) + "\n")
    out = tmp_path / name
    argv = ["progress=false", "threads=1", "data=jsonl", f"data.path={path}", "n_items=1", "policies=[snapkv]",
            "designs=[poisson]", "budgets=[0.25]", "seeds=[1]", f"out_dir={out}", *extra]
    return cli.main(argv), out


@pytest.mark.smollm2
@pytest.mark.slow  # three one-item cells, each loading the model: about 30 s on 2 cores (make test-full)
def test_smollm2_a_cell_at_zero_is_todays_cell_and_one_with_both_runs_end_to_end(tmp_path, capsys, smollm2):
    code, today = _cell(tmp_path, "today")
    assert code == 0, capsys.readouterr().err[-3000:]
    code, zero = _cell(tmp_path, "zero", "design_options.tail_mix=0", "design_options.head_attention_share=0")
    assert code == 0, capsys.readouterr().err[-3000:]
    for name in ("items.parquet", "steps.parquet", "decisions.parquet"):
        assert (today / name).read_bytes() == (zero / name).read_bytes(), name
    lines = lambda cell: [l for l in (cell / "config.yaml").read_text().splitlines() if not l.startswith("out_dir:")]  # noqa: E731
    assert lines(today) == lines(zero) and not any("tail_mix" in line for line in lines(today))
    code, on = _cell(tmp_path, "on", "design_options.tail_mix=0.5", "design_options.head_attention_share=0.5")
    assert code == 0, capsys.readouterr().err[-3000:]
    items, steps = pd.read_parquet(on / "items.parquet"), pd.read_parquet(on / "steps.parquet")
    poisson = items[items["design"] == "poisson"]
    assert (poisson["tail_mix"] == 0.5).all() and (poisson["head_attention_share"] == 0.5).all()
    assert "tail_mix" in steps.columns and np.isfinite(steps["rel_cert"]).any()
    assert "tail_mix" not in pd.read_parquet(today / "items.parquet").columns

    # the library gives the cell's answer with the same options
    model, tokenizer = smollm2
    record = json.loads((tmp_path / "items.jsonl").read_text())
    result = kvcert.generate(model, tokenizer, context=record["context"], question=record["question"],
                             policy="snapkv", design="poisson", budget=0.25, seed=1, item_id=record["id"],
                             max_new_tokens=4, oracle=True,
                             options=DesignOptions(tail_mix=0.5, head_attention_share=0.5))
    assert result.text == poisson["prediction"].iloc[0]

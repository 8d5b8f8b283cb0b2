"""``kvcert.calibration``: the conformal quantile's finite-sample guarantee, the design-based factor, the file
(format, round trip, refusals), applying a calibration, Spearman's ρ, the per-layer table and the model identity.

Statistical windows: each coverage test draws R independent calibration sets (seeded); the fraction of R new
draws covered has standard error √(p(1 − p)/R), and the windows are p ± z·SE with z = 3.29 (a false alarm
at most 0.1% per test when the guarantee holds).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

import kvcert
from kvcert.calibration import (
    DESIGN_Z,
    Calibration,
    apply_calibration,
    by_layer,
    calibration_summary,
    conformal_quantile,
    design_factor,
    design_knobs,
    fit_calibration,
    minimum_prompts,
    model_identity,
    prepare_calibration,
    spearman,
    wilson_interval,
)
from kvcert.designs import DesignOptions
from kvcert.errors import CalibrationError

Z = 3.290526731491926  # two-sided 0.1%
R = 4000


def _window(p: float) -> float:
    return Z * math.sqrt(p * (1 - p) / R)


# --- the conformal quantile ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n, level", [(19, 0.9), (39, 0.95), (99, 0.95), (10, 0.8)])
def test_row_quantile_covers_a_new_exchangeable_row_at_its_exact_rate(n, level):
    """Split conformal with n exchangeable rows: P(new ≤ q) = ⌈(n+1)·level⌉/(n+1), which is ≥ level and
    < level + 1/(n+1). Heavy-tailed scores, as ‖ô − o‖/ε̂ is, change nothing."""
    rng = np.random.default_rng(n)
    scores = rng.standard_cauchy((R, n + 1)) ** 2
    covered = np.mean([scores[r, -1] <= conformal_quantile(scores[r, :-1], level) for r in range(R)])
    exact = math.ceil((n + 1) * level) / (n + 1)
    assert exact >= level
    assert abs(covered - exact) <= _window(exact), (covered, exact)


def test_row_quantile_is_infinite_below_the_smallest_sample_that_can_give_one():
    assert conformal_quantile(np.arange(18.0), 0.95) == math.inf  # ⌈19·0.95⌉ = 19 > 18
    assert conformal_quantile(np.arange(19.0), 0.95) == 18.0
    assert conformal_quantile(np.array([]), 0.95) == math.inf
    with pytest.raises(ValueError, match="level=1.0 must lie in"):
        conformal_quantile(np.arange(5.0), 1.0)


def _clustered(rng, m: int, rows: tuple[int, int] = (5, 40)):
    """m prompts whose rows share a prompt effect (rows of one prompt are strongly dependent), with varying
    row counts; returns scores and prompt labels."""
    counts = rng.integers(rows[0], rows[1], size=m)
    effect = rng.standard_normal(m) * 2.0
    labels = np.repeat(np.arange(m), counts)
    scores = np.exp(effect[labels] + 0.3 * rng.standard_normal(labels.size))
    return scores, labels


@pytest.mark.parametrize("m, level", [(19, 0.95), (9, 0.9), (30, 0.9)])
def test_prompt_quantile_covers_a_new_prompt_in_expectation_however_its_rows_depend(m, level):
    """Prompts exchangeable, rows within a prompt strongly dependent: the mean fraction of a new prompt's rows
    at or below the prompt-weighted quantile is ≥ level (window from R draws of per-prompt fractions, whose
    standard deviation is at most 1/2)."""
    rng = np.random.default_rng(100 + m)
    fractions = []
    for _ in range(R // 4):
        scores, labels = _clustered(rng, m + 1)
        test = labels == m
        q = conformal_quantile(scores[~test], level, labels[~test])
        fractions.append(np.mean(scores[test] <= q))
    assert np.mean(fractions) >= level - Z * 0.5 / math.sqrt(R // 4), np.mean(fractions)


def test_pooling_dependent_rows_as_if_exchangeable_under_covers_where_the_prompt_quantile_does_not():
    """Why ``unit=prompt`` exists: with few prompts whose rows move together, the row quantile falls short of
    its level on a new prompt, the prompt quantile does not."""
    rng = np.random.default_rng(7)
    row, prompt = [], []
    for _ in range(600):
        scores, labels = _clustered(rng, 20)
        test = labels == 19
        row.append(np.mean(scores[test] <= conformal_quantile(scores[~test], 0.95)))
        prompt.append(np.mean(scores[test] <= conformal_quantile(scores[~test], 0.95, labels[~test])))
    assert np.mean(row) < 0.95 - 0.01 and np.mean(prompt) >= 0.95 - 0.02


def test_minimum_prompts():
    assert minimum_prompts(0.95) == 19 and minimum_prompts(0.9) == 9 and minimum_prompts(0.975) == 39
    rng = np.random.default_rng(0)
    scores, labels = _clustered(rng, 18)
    assert conformal_quantile(scores, 0.95, labels) == math.inf
    scores, labels = _clustered(rng, 19)
    assert math.isfinite(conformal_quantile(scores, 0.95, labels))


# --- the design-based factor ----------------------------------------------------------------------------------


def test_design_factor_bounds_and_limits():
    n = np.array([0.0, 1.0, 4.0, 100.0, 1e8, np.nan])
    f = design_factor(n)
    assert f[0] == 1.0 and math.isnan(f[-1])  # no sampled weight: nothing to inflate; NaN stays NaN
    assert f[1] == pytest.approx(math.sqrt(1 + DESIGN_Z))  # one term carries everything: the widest
    assert f[2] == pytest.approx(math.sqrt(1 + DESIGN_Z / 2))
    assert np.all(np.diff(f[1:5]) < 0) and f[4] == pytest.approx(1.0, abs=1e-3)


# --- fitting, the file, refusals ----------------------------------------------------------------------------


def _steps(seed: int = 0, items: int = 24, layers: int = 3, bad_layer: int = 1, budgets=(0.25, 0.5),
           setting: str = "question_aware", policy: str = "snapkv"):
    """Synthetic oracle step rows: in ``bad_layer`` the error is about 4× the certificate's scale."""
    rng = np.random.default_rng(seed)
    frames = []
    for budget in budgets:
        for item in range(items):
            n = 8 * layers
            layer = np.tile(np.arange(layers), 8)
            cert = rng.lognormal(-3, 1, n)
            scale = np.where(layer == bad_layer, 4.0, 0.2)
            err = cert * scale * np.abs(rng.standard_normal(n))
            norm = rng.uniform(1, 2, n)
            frames.append(pd.DataFrame({
                "item_id": f"i{item:03d}", "policy": policy, "design": "poisson", "budget": budget, "seed": 0,
                "setting": setting, "step": np.repeat(np.arange(8), layers), "layer": layer, "kv_head": 0,
                "trace_var": cert**2 * 0.05, "cert": cert, "true_err": err, "rel_cert": cert / norm,
                "rel_err": err / norm, "coverage": (err <= cert).astype(float), "wald_coverage": 0.9,
                "tail_ess": rng.uniform(1, 50, n), "out_norm": norm}))
    return pd.concat(frames, ignore_index=True)


MODEL = {"model_type": "llama", "num_layers": 3, "config_sha256": "c" * 64, "weights_sha256": "w" * 64}
KNOBS = design_knobs(DesignOptions(), delta=0.05, observation_window=16)


def _expected(stratum: dict, rows: pd.DataFrame, never_below_paper: bool = True) -> np.ndarray:
    """The contract of a stratum: q_ℓ · (cert_weight_ℓ · ε̂ + norm_weight_ℓ · ‖ô‖) for a row of layer ℓ, and at
    least ε̂ where the file says so (the default)."""
    layer = rows["layer"].to_numpy()
    pick = lambda name: np.asarray(stratum[name], dtype=float)[layer]  # noqa: E731
    cert = rows["cert"].to_numpy()
    scaled = pick("factors") * (pick("cert_weights") * cert + pick("norm_weights") * rows["out_norm"].to_numpy())
    return np.maximum(scaled, cert) if never_below_paper else scaled


def test_fit_gives_one_factor_per_layer_and_stratum_that_is_the_conformal_quantile():
    steps = _steps()
    cal = fit_calibration(steps, model=MODEL, design=KNOBS, relative_term=False)
    assert cal.level == pytest.approx(0.99) and cal.method == "conformal"  # the default: 1 − δ/5
    assert sorted(cal.strata) == [("question_aware", "snapkv", "poisson", "0.25"), ("question_aware", "snapkv", "poisson", "0.5")]
    stratum = cal.strata[("question_aware", "snapkv", "poisson", "0.25")]
    rows = steps[steps["budget"] == 0.25]
    for layer in range(3):
        sub = rows[rows["layer"] == layer]
        ratio = np.sort((sub["true_err"] / sub["cert"]).to_numpy())
        assert stratum["factors"][layer] == pytest.approx(ratio[math.ceil((len(ratio) + 1) * 0.99) - 1])
        assert stratum["rows"][layer] == len(sub)
    assert stratum["factors"][1] > 5 * stratum["factors"][0]  # the bad layer needs a larger factor
    assert stratum["cert_weights"] == [1.0] * 3 and stratum["norm_weights"] == [0.0] * 3


def test_the_relative_term_is_picked_per_layer_where_it_narrows_the_certificate():
    """In a layer whose error follows ‖ô‖ rather than ε̂ (ε̂ near 0 where the error is not: slots the retained
    set never saw), the fit leans on ‖ô‖; where the error follows ε̂ it keeps ε̂'s shape. Each layer's choice
    is, among the candidates that rank the layer's errors at most RANK_TOLERANCE worse than ε̂, the one with
    the narrowest median certificate at its own conformal quantile."""
    rng = np.random.default_rng(5)
    steps = _steps(seed=5, budgets=(0.25,))
    blind = steps["layer"] == 2
    steps.loc[blind, "cert"] = steps.loc[blind, "cert"] * 10.0 ** rng.uniform(-8, 0, int(blind.sum()))
    steps.loc[blind, "true_err"] = 0.2 * steps.loc[blind, "out_norm"] * rng.uniform(0, 1, int(blind.sum()))
    # A level at which this example's ε̂-shaped layer 0 is best served by ε̂ alone: at 0.99 the quantile of its 192
    # rows is their largest ratio, which τ = 0.003 happens to narrow; the choice is made per level, as checked below.
    cal = fit_calibration(steps, model=MODEL, design=KNOBS, level=0.975, never_below_paper=False)
    stratum = cal.strata[("question_aware", "snapkv", "poisson", "0.25")]
    assert (stratum["cert_weights"][0], stratum["norm_weights"][0]) == (1.0, 0.0)
    assert stratum["norm_weights"][2] > 0 and stratum["factors"][2] < 1e3
    from scipy.stats import spearmanr

    from kvcert.calibration import NORM_WEIGHTS, RANK_TOLERANCE

    for layer in range(3):
        rows = steps[steps["layer"] == layer]
        err, cert, norm = (rows[c].to_numpy() for c in ("true_err", "cert", "out_norm"))
        allowed = {}
        floor = spearmanr(cert, err).statistic - RANK_TOLERANCE
        for weights in [(1.0, tau) for tau in NORM_WEIGHTS] + [(0.0, 1.0)]:
            b = weights[0] * cert + weights[1] * norm
            if spearmanr(b, err).statistic >= floor:
                q = conformal_quantile(err / b, cal.level)
                allowed[weights] = (np.median(q * b), q)
        chosen = (stratum["cert_weights"][layer], stratum["norm_weights"][layer])
        assert chosen in allowed
        assert allowed[chosen][0] == pytest.approx(min(w for w, _ in allowed.values()))
        assert stratum["factors"][layer] == pytest.approx(allowed[chosen][1])


def test_a_file_round_trips_and_says_what_it_is(tmp_path):
    cal = fit_calibration(_steps(), model=MODEL, design=KNOBS, level=0.9, unit="prompt", fitted_on={"items": 24})
    path = tmp_path / "cal.json"
    cal.save(path)
    payload = json.loads(path.read_text())
    assert payload["format"] == "kvcert-calibration" and payload["version"] == 1
    assert payload["level"] == 0.9 and payload["unit"] == "prompt" and payload["model"] == MODEL
    assert payload["design"]["pi_min"] == 0.001 and payload["design"]["delta"] == 0.05
    back = Calibration.load(path)
    assert back.strata == cal.strata and back.model == cal.model and back.design == cal.design
    assert payload["never_below_paper"] is True and back.never_below_paper is True
    assert path.stat().st_size < 20_000  # small: per layer, a factor and a row count


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update(format="other"), "not a kvcert calibration file"),
    (lambda p: p.update(version=2), "format version 2 is not supported (this kvcert reads version 1)"),
    (lambda p: p.update(method="magic"), "method='magic' is unknown; known: ['conformal', 'design']"),
    (lambda p: p.pop("model"), "missing field 'model'"),
    (lambda p: p["strata"][0].pop("factors"), "strata[0] is malformed (KeyError"),
    (lambda p: p["strata"][0]["factors"].__setitem__(0, -1.0), "strata[0] holds a negative factor or weight"),
    (lambda p: p["strata"][0]["norm_weights"].pop(), "or lists of different lengths"),
    (lambda p: p.update(level=1.5), "level=1.5 must lie in (0, 1)"),
])
def test_a_broken_file_is_refused_in_one_line_naming_it(tmp_path, edit, message):
    path = tmp_path / "cal.json"
    payload = fit_calibration(_steps(), model=MODEL, design=KNOBS).to_dict()
    edit(payload)
    path.write_text(json.dumps(payload))
    with pytest.raises(CalibrationError) as info:
        Calibration.load(path)
    assert message in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(CalibrationError, match=r"calibration=.*nope.json: no such file"):
        Calibration.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CalibrationError, match=r"not a kvcert calibration file \(JSONDecodeError"):
        Calibration.load(tmp_path / "bad.json")


def test_another_model_other_knobs_or_a_missing_stratum_are_refused():
    cal = fit_calibration(_steps(), model=MODEL, design=KNOBS)
    cal.source = "cal.json"
    with pytest.raises(CalibrationError, match="was fitted on another model \\(weights differ"):
        cal.check_model({**MODEL, "weights_sha256": "x" * 64})
    with pytest.raises(CalibrationError, match="was fitted on another model \\(architecture/config differ"):
        cal.check_model({**MODEL, "config_sha256": "x" * 64})
    cal.check_model(dict(MODEL))
    for knob, value, label in (("pi_min", 0.01, "design_options.pi_min=0.01 here but 0.001 in the file"),
                               ("n_recent", 64, "design_options.n_recent=64 here but 32 in the file"),
                               ("delta", 0.1, "delta=0.1 here but 0.05 in the file"),
                               ("observation_window", 32, "observation_window=32 here but 16 in the file"),
                               ("policy_options", {"snapkv": {"kernel_size": 7}}, "policy_options=")):
        with pytest.raises(CalibrationError, match=label.replace("(", "\\(")):
            cal.check_design({**KNOBS, knob: value})
    with pytest.raises(CalibrationError, match="has no factors for setting=streaming policy=snapkv design=poisson "
                                               "budget=0.25; it holds .*question_aware/snapkv/poisson/0.25"):
        cal.check_configurations("streaming", [("snapkv", "poisson", 0.25)])
    with pytest.raises(CalibrationError, match="budget=0.3"):
        cal.check_configurations("question_aware", [("snapkv", "poisson", 0.3)])
    cal.check_configurations("question_aware", [("snapkv", "poisson", 0.25), ("snapkv", "topk", 0.3)])  # topk: no cert


def test_fit_refuses_what_it_cannot_fit():
    steps = _steps(items=24)
    with pytest.raises(CalibrationError, match="24 calibration prompts .* unit=prompt at level=0.99 needs at least 99"):
        fit_calibration(steps, model=MODEL, design=KNOBS, unit="prompt")
    fit_calibration(steps, model=MODEL, design=KNOBS, unit="prompt", level=0.95)  # 24 >= 19
    with pytest.raises(CalibrationError, match="10 calibration prompts .* unit=row at level=0.99 needs at least 19"):
        fit_calibration(_steps(items=10), model=MODEL, design=KNOBS)
    with pytest.raises(CalibrationError, match="no step rows with both a certificate and a true error"):
        fit_calibration(steps.assign(true_err=np.nan), model=MODEL, design=KNOBS)
    with pytest.raises(CalibrationError, match="has 192 calibration rows, too few for a finite quantile at level=0.999"):
        fit_calibration(steps, model=MODEL, design=KNOBS, level=0.999)


# --- applying ----------------------------------------------------------------------------------------------


def test_apply_multiplies_the_certificate_by_its_layer_factor_and_scores_it():
    train, test = _steps(seed=1), _steps(seed=2)
    cal = fit_calibration(train, model=MODEL, design=KNOBS)
    rows = test[test["budget"] == 0.25].reset_index(drop=True)
    out = apply_calibration(cal, rows, design="poisson", policy="snapkv", budget=0.25, setting="question_aware",
                            checked=True)
    np.testing.assert_allclose(out["cert_calibrated"], _expected(cal.strata[("question_aware", "snapkv", "poisson", "0.25")], rows))
    np.testing.assert_array_equal(out["coverage_calibrated"], (rows["true_err"] <= out["cert_calibrated"]).astype(float))
    assert list(out.columns[: len(rows.columns)]) == list(rows.columns)  # the step columns are untouched
    # held out, the bad layer is covered near the level while the paper's certificate is not
    bad = out["layer"] == 1
    assert out.loc[bad, "coverage"].mean() < 0.5 and out.loc[bad, "coverage_calibrated"].mean() > 0.85
    # deterministic rows carry no certificate: NaN, not 0
    topk = apply_calibration(cal, rows.assign(cert=np.nan), design="topk", policy="snapkv", budget=0.25,
                             setting="question_aware", checked=True)
    assert topk["cert_calibrated"].isna().all() and topk["coverage_calibrated"].isna().all()
    # where ε̂ = 0 (nothing in the layer's view evicted) the error is float32 rounding: never claim less
    from kvcert.calibration import ROUNDING

    exact = apply_calibration(cal, rows.assign(cert=0.0, true_err=3e-7 * rows["out_norm"]), design="poisson",
                              policy="snapkv", budget=0.25, setting="question_aware", checked=True)
    assert (exact["cert_calibrated"] >= ROUNDING * rows["out_norm"] - 1e-12).all()
    assert exact["coverage_calibrated"].eq(1.0).all()
    # no oracle: the certificate, no coverage
    serving = apply_calibration(cal, rows.assign(true_err=np.nan), design="poisson", policy="snapkv", budget=0.25,
                                setting="question_aware", checked=True)
    assert serving["cert_calibrated"].notna().all() and serving["coverage_calibrated"].isna().all()


def test_the_default_certificate_never_narrows_the_papers_and_covers_at_least_what_either_covers():
    """never_below_paper (the default): max(q · b, ε̂) row by row, so in every layer it covers each row that ε̂ or
    the scaled certificate covers; without it the factor may narrow ε̂ below what ε̂ itself covered."""
    train, test = _steps(seed=1), _steps(seed=2)
    rows = test[test["budget"] == 0.25].reset_index(drop=True)
    floored = fit_calibration(train, model=MODEL, design=KNOBS)
    plain = fit_calibration(train, model=MODEL, design=KNOBS, never_below_paper=False)
    assert floored.never_below_paper and not plain.never_below_paper
    apply = lambda cal: apply_calibration(cal, rows, design="poisson", policy="snapkv", budget=0.25,  # noqa: E731
                                          setting="question_aware", checked=True)
    high, low = apply(floored), apply(plain)
    assert (high["cert_calibrated"] >= rows["cert"]).all()
    assert (low["cert_calibrated"] < rows["cert"]).any()  # this example's factors do narrow ε̂ in some layer
    hit_paper = rows["true_err"] <= rows["cert"]
    for layer, sub in high.groupby("layer"):
        at = rows["layer"] == layer
        either = (hit_paper[at] | (low.loc[at, "coverage_calibrated"] == 1.0)).mean()
        assert sub["coverage_calibrated"].mean() >= either - 1e-12


def test_the_floor_is_applied_when_serving_and_leaves_the_fit_as_it_is():
    steps = _steps(seed=5)
    floored = fit_calibration(steps, model=MODEL, design=KNOBS)
    plain = fit_calibration(steps, model=MODEL, design=KNOBS, never_below_paper=False)
    assert floored.strata == plain.strata


def test_files_written_before_the_floor_existed_apply_as_they_were_fitted(tmp_path):
    payload = fit_calibration(_steps(), model=MODEL, design=KNOBS, never_below_paper=False).to_dict()
    del payload["never_below_paper"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(payload))
    assert Calibration.load(path).never_below_paper is False
    payload["never_below_paper"] = "yes"
    path.write_text(json.dumps(payload))
    with pytest.raises(CalibrationError, match="field 'never_below_paper' has the wrong type"):
        Calibration.load(path)


def test_the_design_correction_needs_no_file_and_the_summary_is_relative():
    rows = _steps(seed=3)
    rows = rows[rows["budget"] == 0.5].reset_index(drop=True)
    out = apply_calibration("design", rows, design="poisson", policy="snapkv", budget=0.5, setting="question_aware")
    np.testing.assert_allclose(out["cert_calibrated"], rows["cert"] * design_factor(rows["tail_ess"]))
    summary = calibration_summary(out)
    relative = rows["rel_cert"] * design_factor(rows["tail_ess"])
    assert summary["cert_calibrated_mean"] == pytest.approx(relative.mean())
    assert summary["cert_calibrated_max"] == pytest.approx(relative.max())
    assert summary["coverage_calibrated"] == pytest.approx(out["coverage_calibrated"].mean())
    assert all(math.isnan(v) for v in calibration_summary(out.iloc[:0]).values())


def test_prepare_checks_everything_before_anything_is_computed(tmp_path):
    cal = fit_calibration(_steps(), model=MODEL, design=KNOBS)
    path = tmp_path / "cal.json"
    cal.save(path)
    loaded = prepare_calibration(str(path), setting="question_aware", configurations=[("snapkv", "poisson", 0.5)])
    assert isinstance(loaded, Calibration) and loaded.source == str(path)
    with pytest.raises(CalibrationError, match="design_options.pi_min=0.01"):
        prepare_calibration(path, setting="question_aware", configurations=[("snapkv", "poisson", 0.5)],
                            options=DesignOptions(pi_min=0.01))
    assert prepare_calibration("design", setting="streaming", configurations=[("uniform", "poisson", 0.3)]) == "design"


# --- Spearman's ρ -------------------------------------------------------------------------------------------


def _average_ranks(v: np.ndarray) -> np.ndarray:
    """Ranks 1..N by their definition, tied values sharing the mean of the ranks they span:
    (number smaller) + (number equal + 1)/2."""
    return np.array([(v < t).sum() + ((v == t).sum() + 1) / 2 for t in v])


def test_spearman_is_the_correlation_of_average_ranks_as_scipy_and_the_preregistered_helper_compute_it():
    from scipy.stats import spearmanr

    from kvcert.analysis.stats import spearman as preregistered

    rng = np.random.default_rng(11)
    x = rng.integers(0, 6, 200).astype(float)  # six values among 200: every value tied many times
    y = x + rng.integers(0, 4, 200)
    by_definition = np.corrcoef(_average_ranks(x), _average_ranks(y))[0, 1]
    ordinal = np.corrcoef(np.argsort(np.argsort(x, kind="stable")), np.argsort(np.argsort(y, kind="stable")))[0, 1]
    assert abs(ordinal - by_definition) > 1e-4  # ties broken by position would give another number
    rho = spearman(x, y)
    assert rho == pytest.approx(by_definition, abs=1e-12)
    assert rho == spearmanr(x, y).statistic  # bit for bit: tables written with SciPy's keep their digits
    assert rho == pytest.approx(float(preregistered(x, y)), abs=1e-12)  # C3's helper, at unit weights
    assert spearman(x, -y) == pytest.approx(-rho, abs=1e-12)


def test_spearman_says_when_nothing_can_be_ranked():
    ramp = np.arange(5.0)
    assert math.isnan(spearman(np.full(5, 0.3), ramp)) and math.isnan(spearman(ramp, np.ones(5)))
    assert math.isnan(spearman(ramp[:2], ramp[:2]))  # two pairs are ranked perfectly, whatever they are
    assert spearman(np.ones(5), ramp, degenerate=-1.0) == -1.0
    assert spearman(ramp, ramp, degenerate=-1.0) == pytest.approx(1.0)
    assert math.isnan(spearman(np.array([0.0, 1.0, np.nan, 3.0, 4.0]), ramp))


def test_a_base_that_is_constant_in_a_layer_ranks_nothing_and_is_never_picked():
    """‖ô‖ alone, constant in layer 2 while the error there is unrelated to ε̂, would give the narrowest
    certificate; it ranks nothing (ρ counts as −1 in the fit, NaN in the table), so the fit keeps ε̂'s shape."""
    steps = _steps(seed=6, budgets=(0.25,))
    flat = steps["layer"] == 2
    steps.loc[flat, "out_norm"] = 1.5
    steps.loc[flat, "true_err"] = np.random.default_rng(6).uniform(0.0, 0.05, int(flat.sum()))
    cal = fit_calibration(steps, model=MODEL, design=KNOBS, never_below_paper=False)
    stratum = cal.strata[("question_aware", "snapkv", "poisson", "0.25")]
    assert stratum["cert_weights"][2] == 1.0
    rows = steps[flat]
    q_norm = conformal_quantile(rows["true_err"].to_numpy() / 1.5, cal.level)
    picked = stratum["factors"][2] * (rows["cert"] + stratum["norm_weights"][2] * 1.5)
    assert np.median(q_norm * 1.5) < np.median(picked)  # it would have been the narrowest
    steps = steps.assign(model="m", cert=np.where(flat, 0.01, steps["cert"]))
    table = by_layer(steps).set_index("layer")["spearman"]
    assert math.isnan(table[2]) and not math.isnan(table[0])


# --- the per-layer table ------------------------------------------------------------------------------------


def test_by_layer_matches_a_direct_computation():
    from scipy.stats import spearmanr

    steps = _steps(seed=4).assign(model="m")
    steps.loc[steps.index[:10], "true_err"] = np.nan  # oracle-less rows are left out
    table = by_layer(steps)
    assert len(table) == 2 * 3
    ok = steps[steps["true_err"].notna()]
    for row in table.itertuples():
        sub = ok[(ok["budget"] == row.budget) & (ok["layer"] == row.layer)]
        covered = (sub["true_err"] <= sub["cert"]).mean()
        assert row.n_rows == len(sub) and row.n_items == sub["item_id"].nunique()
        assert row.coverage == pytest.approx(covered)
        assert row.coverage_low <= covered <= row.coverage_high
        assert row.median_rel_width == pytest.approx(sub["rel_cert"].median())
        assert row.spearman == pytest.approx(spearmanr(sub["cert"], sub["true_err"]).statistic)
        assert row.model == "m" and row.setting == "question_aware" and row.design == "poisson"
    assert "coverage_calibrated" not in table


def test_wilson_interval_against_its_formula_edges():
    low, high = wilson_interval(95, 100)
    assert 0.88 < low < 0.89 and 0.977 < high < 0.979  # the textbook values 0.8882, 0.9785
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


# --- the model identity, and generate() -----------------------------------------------------------------------


def test_model_identity_changes_with_the_weights_and_the_config_but_not_with_the_attention():
    from helpers.tiny_models import build

    _, model, _ = build("llama", seed=0)
    _, same, _ = build("llama", seed=0)
    _, other, _ = build("llama", seed=1)
    first = model_identity(model)
    assert first == model_identity(same) and first["num_layers"] == 2 and first["model_type"] == "llama"
    assert first["weights_sha256"] != model_identity(other)["weights_sha256"]
    with torch.no_grad():
        next(same.parameters()).view(-1)[0] += 1.0
    assert model_identity(same)["weights_sha256"] != first["weights_sha256"]
    with kvcert.attach(model):  # attention switched: still the same model
        assert model_identity(model) == first
    _, mqa, _ = build("llama_mqa", seed=0)
    assert model_identity(mqa)["config_sha256"] != first["config_sha256"]


def _tiny_llama(vocab: int, seed: int):
    from helpers.tiny_models import COMMON
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": vocab})).eval()


def test_generate_adds_the_calibrated_columns_and_refuses_another_models_file_before_computing(monkeypatch):
    from helpers.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    model = _tiny_llama(len(tokenizer), seed=0)
    context, question = "the sky is blue. " * 30 + "the key is 4711. " + "grass is green. " * 30, "what is the key?"
    args = dict(context=context, question=question, policy="snapkv", design="poisson", budget=0.3, max_new_tokens=4,
                oracle=True)
    plain = kvcert.generate(model, tokenizer, **args)
    designed = kvcert.generate(model, tokenizer, **args, calibration="design")
    pd.testing.assert_frame_equal(designed.steps[plain.steps.columns], plain.steps)
    np.testing.assert_allclose(designed.steps["cert_calibrated"], plain.steps["cert"] * design_factor(plain.steps["tail_ess"]))
    assert designed.steps["coverage_calibrated"].notna().all()

    identity = model_identity(model)
    steps = pd.concat([plain.steps.assign(item_id=f"i{i}", policy="snapkv", design="poisson", budget=0.3, seed=0,
                                          setting="question_aware") for i in range(20)], ignore_index=True)
    cal = fit_calibration(steps, model=identity, design=design_knobs())
    fitted = kvcert.generate(model, tokenizer, **args, calibration=cal)
    np.testing.assert_allclose(fitted.steps["cert_calibrated"],
                               _expected(cal.strata[("question_aware", "snapkv", "poisson", "0.3")], plain.steps), rtol=1e-6)

    other = _tiny_llama(len(tokenizer), seed=1)
    monkeypatch.setattr(kvcert.generation, "prefill", lambda *a, **k: pytest.fail("computed before refusing"))
    with pytest.raises(CalibrationError, match="fitted on another model"):
        kvcert.generate(other, tokenizer, **args, calibration=cal)
    with pytest.raises(CalibrationError, match="budget=0.5"):
        kvcert.generate(model, tokenizer, **{**args, "budget": 0.5}, calibration=cal)

"""Each claim function on synthetic cells (tests of our own analysis logic, not of the method).

For every claim we build data where its hypothesis holds by construction and data where it fails
by construction (``kvcert.analysis.synthetic``), and check the verdicts "supported" and
"not supported". Also: missing population rows are a one-line error; a handful of items (smoke
scale) still runs.
"""

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvcert.analysis import claims, synthetic
from kvcert.analysis.errors import AnalysisError

ROOT = Path(__file__).resolve().parents[1]
N_BOOT = 400


@lru_cache(maxsize=1)
def prereg():
    doc = yaml.safe_load((ROOT / "preregistration" / "claims.yaml").read_text())
    return doc["conventions"], {c["id"]: c for c in doc["claims"]}


def run(claim_id, **knobs):
    conv, specs = prereg()
    items, steps = synthetic.make_tables(synthetic.SynthSpec(**knobs))
    opts = claims.options_for(specs[claim_id], conv, n_boot=N_BOOT)
    return claims.run_claim(claim_id, claims.Tables(items, steps), specs[claim_id], conv, opts)


def drop(qa, streaming=0.3, poisson_extra=0.0):
    """Cache-failure probability per (setting, design, budget); ``qa`` may depend on the budget."""
    def f(setting, design, budget):
        base = (qa(budget) if callable(qa) else qa) if setting == "question_aware" else streaming
        return min(1.0, base + (poisson_extra if design == "poisson" else 0.0))
    return f


CASES = {
    # claim: (knobs that make it hold, knobs that make it fail)
    "c1": (dict(drop=drop(0.0)), dict(drop=drop(0.3))),
    "c2": (dict(drop=drop(0.0, streaming=0.3)), dict(drop=drop(0.0, poisson_extra=0.3))),
    "c3": (dict(err_scale=1.0), dict(err_scale=8.0)),
    "c4": (dict(p_full=0.95, drop=drop(0.3), cert_signal=4.0, conf_signal=0.0),
           dict(p_full=0.6, drop=drop(0.3), cert_signal=0.0, conf_signal=1.0)),
    "c5": (dict(drop=drop(lambda b: 0.4 if b < 0.4 else 0.02), cert_signal=4.0),
           dict(drop=drop(lambda b: 0.4 if b < 0.4 else 0.02), cert_signal=-0.9, conf_signal=1.0)),
    "c6": (dict(cert_signal=4.0), dict(cert_signal=0.0)),
    "c7": (dict(cert_signal=4.0, conf_signal=0.3), dict(cert_signal=-0.9, conf_signal=0.3)),
}


@pytest.mark.parametrize("claim_id", sorted(CASES))
def test_supported_when_constructed_to_hold(claim_id):
    res = run(claim_id, n_items=300, seed=11, **CASES[claim_id][0])
    assert res.verdict == "supported", res.details["components"]
    assert res.ci_low <= res.estimate <= res.ci_high
    assert res.agrees == (res.paper_verdict == "supported")


@pytest.mark.parametrize("claim_id", sorted(CASES))
def test_not_supported_when_constructed_to_fail(claim_id):
    res = run(claim_id, n_items=300, seed=12, **CASES[claim_id][1])
    assert res.verdict == "not supported", res.details["components"]


def test_result_serializes_to_strict_json():
    import json
    res = run("c6", n_items=60, seed=3)
    text = json.dumps(res.to_dict(), allow_nan=False)
    back = json.loads(text)
    assert "figure_data" not in back
    # Every field survives the round trip with its value (NaN, which strict JSON lacks, as null).
    assert (back["claim"], back["verdict"], back["component"], back["n"]) == ("c6", res.verdict, res.component, res.n)
    assert back["estimate"] == pytest.approx(res.estimate) and back["ci_low"] <= back["estimate"] <= back["ci_high"]
    assert [c["name"] for c in back["details"]["components"]] == [c["name"] for c in res.details["components"]]


def test_missing_population_rows_name_what_is_missing():
    conv, specs = prereg()
    items, steps = synthetic.make_tables(synthetic.SynthSpec(n_items=20, budgets=(0.5,)))
    with pytest.raises(AnalysisError, match=r"setting=question_aware .*design=topk budget=0.25"):
        claims.run_claim("c1", claims.Tables(items, steps), specs["c1"], conv,
                         claims.options_for(specs["c1"], conv, n_boot=50))


def test_oracle_off_is_reported_for_c3():
    with pytest.raises(AnalysisError, match="true_err is NaN"):
        run("c3", n_items=10, oracle=False)


@pytest.mark.parametrize("claim_id", sorted(CASES))
def test_smoke_scale_few_items_still_runs(claim_id):
    conv, specs = prereg()
    items, steps = synthetic.make_tables(synthetic.SynthSpec(n_items=4, n_seeds=1, seed=5))
    opts = claims.options_for(specs[claim_id], conv, scale="smoke", n_boot=100)
    res = claims.run_claim(claim_id, claims.Tables(items, steps), specs[claim_id], conv, opts)
    assert res.details["run"]["n_boot_below_preregistered"] is True
    # The smoke options change the bootstrap's size, not the point estimates: every component's estimate is the
    # one the same four items give under the default options, and so are the binding component and n.
    default = claims.run_claim(claim_id, claims.Tables(items, steps), specs[claim_id], conv,
                               claims.options_for(specs[claim_id], conv, n_boot=N_BOOT))
    assert (res.component, res.n) == (default.component, 4)
    assert [c["estimate"] for c in res.details["components"]] == pytest.approx(
        [c["estimate"] for c in default.details["components"]], nan_ok=True)
    assert res.estimate == pytest.approx(default.estimate, nan_ok=True)
    # The claim's verdict combines its components' verdicts by the pre-registered rule.
    parts = [c["verdict"] for c in res.details["components"]]
    combined = ("supported" if all(v == "supported" for v in parts) else
                "not supported" if "not supported" in parts else "inconclusive")
    assert res.verdict == combined


def test_no_failures_makes_attribution_inconclusive_not_an_error():
    res = run("c6", n_items=5, p_full=1.0, drop=drop(0.0, streaming=0.0))
    assert res.verdict == "inconclusive" and np.isnan(res.estimate)

"""The live analyses give the frozen modules' claim JSONs on the same cell tables.

kvcert.analysis.registry's ``amendment2`` base (version 1's claims with C4 and C6 from
kvcert.analysis.discrimination, AUC method ``sklearn``) must give, for every claim, the JSON of the frozen module
amendment2.py; version 4's analysis (that base plus the named C5 variant) the JSON of the frozen variants.py
plumbing over amendment2.py; and ``discrimination``'s C4 and C6 with method ``mann_whitney`` version 1's. The
tables are synthetic, in each study's shape: version 1's (one model, budgets 0.1-0.75, about half the full-cache
runs failing), versions 2 and 3's (two models, almost no inherent failures), version 4's (two models on tasks
where inherent failures are common), with tied signals (rank ties are where AUC codes differ), and a table
without failing runs. Every number is test data, never a result.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from kvcert.analysis import amendment2, claims, discrimination, prereg, registry, synthetic, variants

ROOT = prereg.find_root(__file__)
CLAIMS = ("c1", "c2", "c3", "c4", "c5", "c6", "c7")
SHAPES = {  # study shape -> (models, SynthSpec knobs)
    "v1": (("smollm2",), {"budgets": (0.1, 0.25, 0.5, 0.75), "p_full": 0.54}),
    "v2_v3": (("smollm2", "gemma3"), {"p_full": 0.97}),
    "v4": (("smollm2", "gemma3"), {"p_full": 0.7}),
}


def _tables(shape: str, seed: int) -> claims.Tables:
    models, knobs = SHAPES[shape]
    items, steps = [], []
    for k, model in enumerate(models):
        spec = synthetic.SynthSpec(n_items=40, seed=10 * seed + k, cert_signal=0.7 + k, conf_signal=0.4,
                                   model=model, **knobs)
        i, s = synthetic.make_tables(spec)
        for frame in (i, s):
            if frame is not None and "item_id" in frame:
                frame["item_id"] = model + "/" + frame["item_id"].astype(str)
        items.append(i)
        steps.append(s)
    items = pd.concat(items, ignore_index=True)
    items["cert_mean"] = items["cert_mean"].round(1)  # ties
    items["logprob_mean"] = items["logprob_mean"].round(0)
    return claims.Tables(items=items, steps=pd.concat(steps, ignore_index=True))


def _json(result: claims.ClaimResult) -> str:
    return json.dumps(result.to_dict(), indent=2, sort_keys=False, allow_nan=False)


def _run(run_claim, claim_id: str, tables: claims.Tables):
    doc = prereg.load_claims(ROOT)
    spec = prereg.claim_spec(doc, claim_id)
    opts = claims.options_for(spec, doc["conventions"], n_boot=60, seed=5)
    return run_claim(claim_id, tables, spec, doc["conventions"], opts)


def _same_figures(a: claims.ClaimResult, b: claims.ClaimResult) -> None:
    for signal, curve in a.figure_data.get("roc", {}).items():
        for axis in ("fpr", "tpr"):
            np.testing.assert_array_equal(curve[axis], b.figure_data["roc"][signal][axis])


@pytest.fixture(scope="module", params=[(shape, seed) for seed, shape in enumerate(SHAPES)],
                ids=lambda p: f"{p[0]}-seed{p[1]}")
def tables(request) -> claims.Tables:
    return _tables(*request.param)


@pytest.mark.parametrize("claim_id", CLAIMS)
def test_the_live_amendment_2_analysis_gives_the_frozen_modules_json(tables, claim_id):
    _, live = registry.analysis(prereg.version(2, ROOT))
    ours, frozen = _run(live, claim_id, tables), _run(amendment2.run_claim, claim_id, tables)
    assert _json(ours) == _json(frozen)
    _same_figures(ours, frozen)


@pytest.mark.parametrize("claim_id", CLAIMS)
def test_the_live_version_4_analysis_gives_the_frozen_modules_json(tables, claim_id):
    _, live = registry.analysis(prereg.version(4, ROOT))
    _, frozen = variants.with_variants(amendment2.REGISTRY, amendment2.run_claim, {"c5_gating": "within_model"},
                                       "preregistration/amendment-4.yaml")
    assert _json(_run(live, claim_id, tables)) == _json(_run(frozen, claim_id, tables))


@pytest.mark.parametrize("claim_id, make", [("c4", discrimination.prediction), ("c6", discrimination.attribution)])
def test_mann_whitney_gives_version_1s_json(tables, claim_id, make):
    live = registry.runner({**claims.REGISTRY, claim_id: claims.ClaimDef(make("mann_whitney"), ("items",))})
    ours, frozen = _run(live, claim_id, tables), _run(claims.run_claim, claim_id, tables)
    assert _json(ours) == _json(frozen)
    _same_figures(ours, frozen)


def test_without_failing_runs_both_are_inconclusive_alike():
    items, _ = synthetic.make_tables(synthetic.SynthSpec(n_items=6, seed=2, p_full=1.0, steps=False,
                                                         drop=lambda *_: 0.0))
    tables = claims.Tables(items=items)
    _, live = registry.analysis(prereg.version(2, ROOT))
    for claim_id in ("c4", "c6"):
        try:
            frozen = _json(_run(amendment2.run_claim, claim_id, tables))
        except Exception as err:  # the frozen code refuses: the live code must refuse the same way
            with pytest.raises(type(err), match=str(err)[:40].replace("(", r"\(").replace(")", r"\)")):
                _run(live, claim_id, tables)
            continue
        assert _json(_run(live, claim_id, tables)) == frozen


def test_the_auc_methods_are_an_open_registry():
    assert set(discrimination.AUC_METHODS) >= {"mann_whitney", "sklearn"}
    live_registry, _ = registry.analysis(prereg.version(3, ROOT))
    assert all(live_registry[c] is claims.REGISTRY[c] for c in ("c1", "c2", "c3", "c5", "c7"))
    assert live_registry["c4"].fn.__name__ == "claim_prediction" and live_registry["c4"].fn is not amendment2.claim_prediction

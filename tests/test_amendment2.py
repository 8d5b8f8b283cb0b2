"""Amendment 2 changes only how C4 and C6 compute AUCs (scikit-learn): on the same data it must give version
1's numbers. Synthetic cell tables in the runner's schema (with tied signals, as real certificates of
deterministic rows and confidences can be) and the version-1 pass-key data the smoke scale runs in CI."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcert.analysis import amendment2, claims, prereg, stats, synthetic
from kvcert.scales import load_scale, override_value, scales_folder, studies

ROOT = prereg.find_root(__file__)


def _both(claim_id: str, tables: claims.Tables, n_boot: int = 200):
    doc = prereg.load_claims(ROOT)
    spec = prereg.claim_spec(doc, claim_id)
    opts = claims.options_for(spec, doc["conventions"], n_boot=n_boot)
    v1 = claims.run_claim(claim_id, tables, spec, doc["conventions"], opts)
    v2 = amendment2.run_claim(claim_id, tables, spec, doc["conventions"], opts)
    return v1, v2


def _assert_same(v1: claims.ClaimResult, v2: claims.ClaimResult, tol: float = 1e-12) -> None:
    assert (v1.verdict, v1.component, v1.n) == (v2.verdict, v2.component, v2.n)
    for field in ("estimate", "ci_low", "ci_high"):
        a, b = getattr(v1, field), getattr(v2, field)
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol, (field, a, b)
    for key, value in v1.details.items():
        if isinstance(value, dict) and "estimate" in value:
            for field in ("estimate", "ci_low", "ci_high", "n_invalid"):
                a, b = value[field], v2.details[key][field]
                assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol, (key, field, a, b)
    for signal, curve in v1.figure_data.get("roc", {}).items():  # the same ROC points, tie groups merged
        other = v2.figure_data["roc"][signal]
        from sklearn.metrics import auc

        assert abs(auc(curve["fpr"], curve["tpr"]) - auc(other["fpr"], other["tpr"])) <= tol


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("claim_id", ["c4", "c6"])
def test_scikit_learn_aucs_give_version_1_numbers(claim_id, seed):
    spec = synthetic.SynthSpec(n_items=60, seed=seed, cert_signal=0.7, conf_signal=0.4, steps=False)
    items, _ = synthetic.make_tables(spec)
    # ties: round the signals so that many runs share a value (rank ties are where AUC codes differ)
    items["cert_mean"] = items["cert_mean"].round(1)
    items["logprob_mean"] = items["logprob_mean"].round(0)
    v1, v2 = _both(claim_id, claims.Tables(items=items))
    _assert_same(v1, v2)


def test_the_other_claims_are_version_1_code_itself():
    for claim_id in ("c1", "c2", "c3", "c5", "c7"):
        assert amendment2.REGISTRY[claim_id] is claims.REGISTRY[claim_id]
    assert amendment2.REGISTRY["c4"].fn is not claims.REGISTRY["c4"].fn


def test_weighted_auc_equals_the_mann_whitney_auc_of_the_expanded_sample():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, size=40).astype(float)  # many ties
    labels = rng.random(40) < 0.4
    weights = rng.multinomial(40, np.full(40, 1 / 40), size=50).astype(float)
    ours = amendment2.weighted_auc(scores, labels, weights)
    version_1 = stats.auc(scores, labels, weights)
    np.testing.assert_allclose(ours, version_1, rtol=0, atol=1e-12)
    expanded = [np.repeat(np.arange(40), w.astype(int)) for w in weights[:5]]
    for b, idx in enumerate(expanded):  # the textbook definition on the expanded sample
        pos, neg = scores[idx][labels[idx]], scores[idx][~labels[idx]]
        mw = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
        assert abs(ours[b] - mw) <= 1e-12
    assert np.isnan(amendment2.weighted_auc(scores, np.zeros(40, bool), weights[:1]))[0]


def _scale_counts(scale: str, study: str) -> dict:
    counts: dict = {}
    for name, cell in studies(load_scale(scale, scales_folder(ROOT)))[study]["cells"].items():
        kind, model = name.split("-", 1)
        n = int(override_value(cell["overrides"], "n_items"))
        counts.setdefault(model, {})[{"qa": "question_aware", "oracle": "oracle", "streaming": "streaming"}[kind]] = n
    return counts


@pytest.mark.parametrize("scale, study, number, design", [("v2", "v2", 2, "reproduce_90_minutes"),
                                                          ("v2-full", "v2-full", 2, "reproduce_full"),
                                                          ("v3", "v3", 3, "reproduce_90_minutes")])
def test_the_scales_run_the_locked_design(scale, study, number, design):
    """The workflow's scale files run exactly the item counts the locked amendment states."""
    amendment = prereg.load_amendment(ROOT, number)
    expected = {m: v for m, v in amendment["design"][design].items() if m != "pooled"}
    assert _scale_counts(scale, study) == expected
    pooled = amendment["design"][design]["pooled"]
    assert pooled["question_aware_items"] == sum(v["question_aware"] + v["oracle"] for v in expected.values())
    assert pooled["streaming_items"] == sum(v["streaming"] for v in expected.values())

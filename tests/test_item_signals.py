"""The item-level signals behind C4-C7 are checked where they are made: a real SmolLM2 cell is run in this process,
every configuration's decoded output is captured as the runner receives it, and each row of items.parquet is
recomputed from it and from the stored step rows.

Recomputed here, independently of kvcert.runner.tables: ``cert_mean`` / ``cert_max`` (mean / max of the finite
relative certificates of the run's step rows), ``true_err_mean`` / ``true_err_max`` (the same of the relative
true errors, oracle on), ``logprob_mean`` / ``logprob_min`` / ``logprob_first`` (of the decoded greedy tokens'
log-probabilities), and ``new_tokens``, ``prediction``, ``score``, ``correct``, ``retained_tokens``. Agreement
must be exact (==), not approximate: these columns are the claims' inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from helpers.cells import KEY_COLUMNS

pytestmark = pytest.mark.smollm2

OVERRIDES = ["model=smollm2", "data=ruler", "data.tasks=[niah_multikey_2]", "data.context_tokens=300", "n_items=2",
             "policies=[snapkv]", "designs=[topk,poisson]", "budgets=[0.25,0.5]", "seeds=[0,1]", "oracle=true",
             "setting=question_aware", "threads=1", "progress=false"]


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    """(items, steps, decoded outputs in the order the runner wrote their rows, tokenizer, items of the cell)."""
    import kvcert
    from kvcert.data import load_items
    from kvcert.runner import cell as cell_module
    from kvcert.runner import cli

    captured = []
    real = cell_module.decode_configurations

    def capture(*args, **kwargs):
        out = real(*args, **kwargs)
        captured.extend(out)
        return out

    out_dir = tmp_path_factory.mktemp("signals") / "cell"
    patch = pytest.MonkeyPatch()
    patch.setattr(cell_module, "decode_configurations", capture)
    threads = torch.get_num_threads()
    try:
        assert cli.main([*OVERRIDES, f"out_dir={out_dir}"]) == 0
    finally:
        patch.undo()
        torch.set_num_threads(threads)
    _, tokenizer = kvcert.load_model("smollm2")
    items = {item.id: item for item in load_items("ruler", {"name": "ruler", "tasks": ["niah_multikey_2"],
                                                            "context_tokens": 300}, tokenizer, 2)}
    return (pd.read_parquet(out_dir / "items.parquet"), pd.read_parquet(out_dir / "steps.parquet"), captured,
            tokenizer, items)


def _finite(values) -> list[float]:
    return [float(v) for v in values if math.isfinite(float(v))]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_every_row_has_its_decoded_output(cell):
    items, _, decoded, _, _ = cell
    # 2 items x (full + top-k at 2 budgets + Poisson at 2 budgets x 2 seeds) = 2 x 7 rows, one decode each.
    assert len(items) == len(decoded) == 14


def test_logprob_and_answer_columns_are_the_decoded_tokens(cell):
    items, _, decoded, tokenizer, by_id = cell
    from kvcert.data import is_correct, score_item

    for row, out in zip(items.itertuples(index=False), decoded):
        logprobs = [float(x) for x in out.logprobs]
        assert len(logprobs) == len(out.token_ids) == row.new_tokens >= 1
        assert row.logprob_mean == float(np.mean(logprobs)), (row.item_id, row.policy, row.design, row.budget, row.seed)
        assert row.logprob_min == min(logprobs) and row.logprob_first == logprobs[0]
        prediction = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert row.prediction == prediction
        score = float(score_item(by_id[row.item_id], prediction))
        assert row.score == score and row.correct == bool(is_correct(score, row.metric))
        assert row.retained_tokens == out.retained_tokens


SUMMARIES = (("cert", "rel_cert"), ("true_err", "rel_err"))


def _summary(values) -> tuple[float, float]:
    finite = _finite(values)
    return (float(np.mean(finite)), max(finite)) if finite else (math.nan, math.nan)


def _runs(cell):
    """(item row, decoded output, stored step rows or None) of every run."""
    items, steps, decoded, _, _ = cell
    by_run = {key: rows for key, rows in steps.groupby(KEY_COLUMNS)}
    for row, out in zip(items.itertuples(index=False), decoded):
        yield row, out, by_run.get(tuple(getattr(row, c) for c in KEY_COLUMNS))


def test_stored_step_rows_are_the_decoded_rows_in_float32(cell):
    """steps.parquet holds every certified run's decoded step rows, rounded to float32 (its storage format)."""
    poisson = 0
    for row, out, stored in _runs(cell):
        key = (row.item_id, row.policy, row.design, row.budget, row.seed)
        if row.policy == "full":
            assert stored is None and len(out.steps) == 0
            assert all(math.isnan(getattr(row, c)) for c in ("cert_mean", "cert_max", "true_err_mean", "true_err_max"))
            continue
        assert stored is not None and len(stored) == len(out.steps) > 0, key
        for _, rel in SUMMARIES:
            made = out.steps[rel].to_numpy(dtype=float)
            assert np.array_equal(made.astype(np.float32), stored[rel].to_numpy(), equal_nan=True), (key, rel)
        if row.design == "poisson":
            assert math.isfinite(row.cert_mean) and row.cert_mean > 0
            poisson += 1
        else:
            assert math.isnan(row.cert_mean)  # a deterministic design has no certificate
        assert math.isfinite(row.true_err_mean)
    assert poisson == 8


def test_item_summaries_are_exactly_those_of_the_stored_step_rows(cell):
    """cert_* and true_err_* are the mean / max of the finite stored step rows, to the last bit."""
    mismatched, compared = [], 0
    for row, _, stored in _runs(cell):
        if stored is None:
            continue
        for column, rel in SUMMARIES:
            mean, top = _summary(stored[rel])
            compared += 1
            if not (_same(getattr(row, f"{column}_mean"), mean) and _same(getattr(row, f"{column}_max"), top)):
                mismatched.append((row.item_id, row.design, row.budget, row.seed, column))
    assert compared == 2 * 12 and not mismatched, mismatched

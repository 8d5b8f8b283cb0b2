"""The library and the pipeline give the same answer for the same item: ``kvcert.generate`` builds the prompt
with the function the cell runner uses (answer prefix, truncation) and seeds Poisson draws per item as the
runner does, so it returns the prediction ``kvcert-run`` records for a JSONL item with the same fields."""

from __future__ import annotations

import json

import pandas as pd
import pytest

import kvcert
from kvcert.runner import cli
from kvcert.theory import passkey_prompt

pytestmark = pytest.mark.smollm2

CONFIGURATIONS = [("full", "full", 1.0, 0), ("snapkv", "topk", 0.5, 0), ("snapkv", "poisson", 0.5, 3),
                  ("snapkv", "poisson", 0.25, 3)]


@pytest.mark.parametrize("setting, limit", [("streaming", None), ("question_aware", 300)])
@pytest.mark.slow  # make test-full: keeps make test near 12 minutes
def test_generate_returns_the_prediction_kvcert_run_records(tmp_path, setting, limit, capsys, smollm2):
    context, question, answer = passkey_prompt(n_noise=14, n_needles=2, seed=5)
    question, prefix = question.split("?")[0] + "?", question.split("?")[1]
    record = {"id": "agreement/0", "context": context, "question": question, "answer_prefix": prefix,
              "answers": [answer], "max_new_tokens": 6}
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps(record) + "\n")
    out = tmp_path / "cell"
    argv = ["progress=false", "threads=1", "data=jsonl", f"data.path={path}", "n_items=1", "policies=[snapkv]",
            "designs=[topk,poisson]", "budgets=[0.25,0.5]", "seeds=[3]", f"setting={setting}", f"out_dir={out}"]
    if limit is not None:
        argv.append(f"max_context_tokens={limit}")  # below the prompt's length: the middle of the context is cut
    assert cli.main(argv) == 0, capsys.readouterr().err[-3000:]
    items = pd.read_parquet(out / "items.parquet").set_index(["policy", "design", "budget", "seed"])

    model, tokenizer = smollm2
    for policy, design, budget, seed in CONFIGURATIONS:
        result = kvcert.generate(
            model, tokenizer, context=context, question=question, answer_prefix=prefix, policy=policy,
            design=design, budget=budget, seed=seed, item_id=record["id"], setting=setting, max_new_tokens=6,
            max_context_tokens=limit,
        )
        row = items.loc[(policy, design, budget, seed)]
        assert result.text == row["prediction"], (policy, design, budget, seed)
        assert result.context_tokens == row["context_tokens"]
    if limit is not None:
        assert int(items["context_tokens"].iloc[0]) + 6 <= limit  # the truncation did apply to both

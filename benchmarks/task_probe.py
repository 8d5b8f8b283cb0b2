"""Exploratory, not pre-registered: which RULER tasks can a model answer with the full cache?

Greedy question-aware decoding with the full cache (no compressed run, so no claim's statistic is read), on
items of a data seed no study uses, prompts and scoring as the cell runner makes them. It answers one question
a planner asks before writing an amendment: does this model reach a task's full-cache band at all?

    python benchmarks/task_probe.py --model gemma3 --seed 9501 --items 20 --out results/probes/gemma3.csv

Default variants: variable tracking (one chain, one and two hops) with RULER's worked example, and frequent
words extraction at 1024 and 512 tokens; ``--tasks`` takes others as a JSON list of ``data.tasks`` entries
(each with its ``context_tokens``). The CSV has one row per variant: items, correct, accuracy, CPU seconds
per item, and the first item's answer beside its reference.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd

VARIANTS = [
    {"name": "vt", "label": "vt_1_example", "num_chains": 1, "num_hops": 1, "example_words": 300,
     "context_tokens": 1024},
    {"name": "vt", "label": "vt_2_example", "num_chains": 1, "num_hops": 2, "example_words": 300,
     "context_tokens": 1024},
    {"name": "fwe", "label": "fwe_1024", "context_tokens": 1024},
    {"name": "fwe", "label": "fwe_512", "context_tokens": 512},
]


def probe(model_name: str, variants: list[dict], seed: int, n_items: int) -> pd.DataFrame:
    import torch
    from tqdm import tqdm

    import kvcert
    from kvcert.data import is_correct, load_items, score_item

    model, tokenizer = kvcert.load_model(model_name)
    rows = []
    for variant in variants:
        items = load_items("ruler", {"name": "ruler", "tasks": [variant], "seed": seed}, tokenizer, n_items)
        correct, first = 0, None
        start = time.process_time()
        for item in tqdm(items, desc=f"{model_name} {items[0].task}", leave=False):
            # the prediction kvcert-run records for this item with the full cache, question-aware
            answer = kvcert.generate(model, tokenizer, context=item.context, question=item.question,
                                     answer_prefix=item.answer_prefix, policy="full", certify=False, oracle=False,
                                     max_new_tokens=int(item.max_new_tokens)).text
            correct += bool(is_correct(score_item(item, answer), item.metric))
            first = first or (answer, item.answers)
        rows.append({"model": model_name, "task": items[0].task, "variant": json.dumps(variant, sort_keys=True),
                     "seed": seed, "n_items": len(items), "n_correct": correct,
                     "accuracy": round(correct / len(items), 4),
                     "cpu_s_per_item": round((time.process_time() - start) / len(items), 2),
                     "threads": torch.get_num_threads(),
                     "first_answer": first[0].strip(), "first_reference": " ".join(first[1])})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a model spec (smollm2, gemma3, hf:<dir>, gguf:<file>)")
    parser.add_argument("--seed", type=int, required=True, help="a data seed no study uses (see amendments)")
    parser.add_argument("--items", type=int, default=20)
    parser.add_argument("--tasks", type=json.loads, default=VARIANTS, help="JSON list of data.tasks entries")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="CSV to write (atomically); the table is printed either way")
    args = parser.parse_args(argv)
    import torch

    from kvcert.atomic import write_text_atomic

    torch.set_num_threads(args.threads)
    table = probe(args.model, args.tasks, args.seed, args.items)
    print(table.drop(columns=["variant"]).to_string(index=False))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(table.to_csv(index=False), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

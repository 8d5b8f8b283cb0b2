"""Exploratory, not pre-registered: full-cache accuracy with and without the model's chat template.

The paper scale prompts as kvpress does (``chat_template=true``: the tokenizer's chat template frames context and
question as one user turn and opens the assistant's); every committed study of the bundled models joined the raw
texts. This probe asks what the template changes for the bundled models, with the full cache (no compressed run,
so no claim's statistic is read), on items of a data seed no study uses (SEED), with prompts and scoring as the
cell runner makes them (``kvcert.generate`` with ``policy="full"``, question-aware; with the full cache the
streaming setting decodes the same tokens).

Tasks, fixed before any item was run: each model's task of amendment 4 (preregistration/amendment-4/design.yaml:
SmolLM2 two-needle multikey at 512 tokens, Gemma 3 four-needle multikey at 1024), and the three families the
bundled models could not do in amendment 4's pilot and the task probe (results/probes): variable tracking with
RULER's worked example (one hop, 1024 tokens), common words (one common word, 1024 tokens) and frequent words
(512 tokens). N_ITEMS items per model, task and template; the interval is Wilson's 95% score interval.

    python benchmarks/chat_template_probe.py            # both bundled models, writes OUT

The table is printed and written (atomically, rewritten after each finished row, so that a stopped run leaves
its finished rows) to results/exploratory/chat-template/accuracy.csv: model, task, chat_template, n_items,
n_correct, accuracy, ci_low, ci_high, cpu_s_per_item, first_answer, first_reference, note.
A model whose tokenizer has no chat template is not run: the option refuses it, so there is nothing to compare;
its rows (chat_template true, n_items 0) say so in ``note``. The bundled Gemma 3 270M is such a model: it is the
pre-trained model, and its GGUF carries no template.

N_ITEMS was set to 10 before any accuracy was read, down from a first choice of 15 when the first run measured
about 30 s per item on the shared 2 cores (a full run would have taken over an hour).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pandas as pd

SEED = 5757  # a data seed no study, pilot or probe uses
N_ITEMS = 10
Z95 = 1.959963984540054
OUT = Path("results/exploratory/chat-template/accuracy.csv")
COLUMNS = ["model", "task", "chat_template", "n_items", "n_correct", "accuracy", "ci_low", "ci_high", "cpu_s_per_item",
           "first_answer", "first_reference", "note"]
MODELS = ("smollm2", "gemma3")
# amendment 4's task per model (its design's data.tasks entry)
AMENDMENT_4 = {
    "smollm2": {"name": "niah_multikey", "label": "niah_multikey_2_512", "num_needles": 2, "context_tokens": 512},
    "gemma3": {"name": "niah_multikey", "label": "niah_multikey_4", "num_needles": 4, "context_tokens": 1024},
}
UNSOLVED = [
    {"name": "vt", "label": "vt_1_example", "num_chains": 1, "num_hops": 1, "example_words": 300,
     "context_tokens": 1024},
    {"name": "cwe", "label": "cwe_1", "num_common": 1, "max_new_tokens": 20, "context_tokens": 1024},
    {"name": "fwe", "label": "fwe_512", "context_tokens": 512},
]


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a binomial proportion ``correct / n``."""
    if n == 0:
        return float("nan"), float("nan")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def probe(model_name: str, variants: list[dict], seed: int, n_items: int, done=lambda row: None) -> list[dict]:
    """One row per task and template: the full cache's answers to the same items with and without the template;
    ``done`` is called with each row as it is finished."""
    from tqdm import tqdm

    import kvcert
    from kvcert.data import is_correct, load_items, score_item

    from kvcert.prompts import has_chat_template

    if not has_chat_template(kvcert.load_tokenizer(model_name)):  # chat_template=true refuses such a model
        return [{"model": model_name, "task": variant["label"], "chat_template": True, "n_items": 0,
                 "note": "not run: the tokenizer has no chat template (chat_template=true refuses the model), so "
                         "there is nothing to compare"} for variant in variants]
    model, tokenizer = kvcert.load_model(model_name)
    rows = []
    for variant in variants:
        items = load_items("ruler", {"name": "ruler", "tasks": [variant], "seed": seed}, tokenizer, n_items)
        for chat_template in (False, True):
            correct, first = 0, None
            start = time.process_time()
            for item in tqdm(items, desc=f"{model_name} {items[0].task} chat_template={chat_template}", leave=False):
                answer = kvcert.generate(model, tokenizer, context=item.context, question=item.question,
                                         answer_prefix=item.answer_prefix, policy="full", certify=False,
                                         oracle=False, max_new_tokens=int(item.max_new_tokens),
                                         chat_template=chat_template).text
                correct += bool(is_correct(score_item(item, answer), item.metric))
                first = first or (answer, item.answers)
            low, high = wilson(correct, len(items))
            rows.append({"model": model_name, "task": items[0].task, "chat_template": chat_template,
                         "n_items": len(items), "n_correct": correct, "accuracy": round(correct / len(items), 4),
                         "ci_low": round(low, 4), "ci_high": round(high, 4),
                         "cpu_s_per_item": round((time.process_time() - start) / len(items), 2),
                         "first_answer": " ".join(first[0].split())[:120], "first_reference": " ".join(first[1]),
                         "note": ""})
            done(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated bundled models")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT, help="CSV to write (atomically)")
    args = parser.parse_args(argv)
    import torch

    from kvcert.atomic import write_text_atomic

    torch.set_num_threads(args.threads)
    names = args.models.split(",")
    for name in names:
        if name not in AMENDMENT_4:
            parser.error(f"--models: {name!r} is not a bundled model; known: {', '.join(MODELS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def write(row: dict | None = None) -> None:  # the rows so far, rewritten whole after each one (a stopped run
        if row is not None:                       # leaves the finished rows)
            rows.append(row)
        write_text_atomic(pd.DataFrame(rows, columns=COLUMNS).to_csv(index=False), args.out)

    for name in names:
        for row in probe(name, [AMENDMENT_4[name], *UNSOLVED], SEED, N_ITEMS, done=write):
            if row["n_items"] == 0:
                write(row)
    table = pd.DataFrame(rows, columns=COLUMNS)
    print(table.drop(columns=["first_answer", "first_reference", "note"]).to_string(index=False, na_rep="-"))
    for row in rows:
        if row["note"]:
            print(f"{row['model']} {row['task']} chat_template=true: {row['note']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

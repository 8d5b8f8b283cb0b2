"""The pilot of a pre-registration amendment: full-cache accuracy of candidate tasks, with curtailment.

    python workflow/scripts/pilot.py --amendment preregistration/amendment-2.yaml --model smollm2 --out pilot-smollm2.csv

For one model, every family's variants are tried in the amendment's order (``pilot.families``); a variant
runs on ``pilot.n_items`` items of seed ``pilot.items_seed`` with the full cache only and stops as soon as it
can no longer reach ``pilot.threshold`` (curtailment: it changes no decision). A family stops at its first
passing variant. Writes one CSV row per variant tried: model, family, task, n run, n correct, accuracy,
whether it passed, whether it was curtailed, CPU seconds per item (prefill + greedy decode). Nothing
compressed is run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import yaml

import kvcert
from kvcert.atomic import write_text_atomic
from kvcert.data import is_correct, load_items, score_item
from kvcert.generation import eos_ids
from kvcert.prompts import model_limit
from kvcert.runner.cell import item_prompt

COLUMNS = ["round", "model", "family", "task", "n_run", "n_correct", "accuracy", "passed", "curtailed", "cpu_s_per_item",
           "prompt_tokens_mean"]


def _label(variant) -> str:
    return variant if isinstance(variant, str) else variant.get("label") or variant["name"]


def run_variant(model, tokenizer, variant, pilot: dict) -> dict:
    n, threshold = int(pilot["n_items"]), float(pilot["threshold"])
    allowed_failures = n - math.ceil(threshold * n)
    cfg = {"name": "ruler", "tasks": [variant], "seed": int(pilot["items_seed"]),
           "context_tokens": int(pilot["context_tokens"])}
    items = load_items("ruler", cfg, tokenizer, n)
    stop, limit = eos_ids(model, tokenizer), model_limit(model)
    correct = failed = 0
    cpu, tokens = 0.0, []
    for item in items:
        prompt = item_prompt(tokenizer, item, "question_aware", limit, "middle")
        start = time.process_time()
        state = kvcert.prefill(model, prompt.prefix_ids, prompt.suffix_ids)
        decoded = kvcert.decode(model, state, None, max_new_tokens=int(item.max_new_tokens), stop_ids=stop,
                                certify=False)
        cpu += time.process_time() - start
        tokens.append(state.context_tokens)
        ok = is_correct(score_item(item, tokenizer.decode(decoded.token_ids, skip_special_tokens=True)), item.metric)
        correct += ok
        failed += not ok
        if failed > allowed_failures:
            break
    run = correct + failed
    return {"task": _label(variant), "n_run": run, "n_correct": correct, "accuracy": round(correct / run, 4),
            "passed": failed <= allowed_failures and run == n, "curtailed": run < n,
            "cpu_s_per_item": round(cpu / run, 3), "prompt_tokens_mean": round(sum(tokens) / len(tokens), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--amendment", type=Path, required=True)
    parser.add_argument("--model", required=True, help="a bundled model name (smollm2, gemma3) or model spec")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--round", type=int, default=1, help="2: the variants of pilot.round_2")
    args = parser.parse_args(argv)
    pilot = yaml.safe_load(args.amendment.read_text())["pilot"]
    families = pilot["families"] if args.round == 1 else pilot[f"round_{args.round}"]["families"]
    torch.set_num_threads(args.threads)
    model, tokenizer = kvcert.load_model(args.model)
    rows = []
    for family, variants in families.items():
        for variant in variants:
            row = {"round": args.round, "model": args.model, "family": family,
                   **run_variant(model, tokenizer, variant, pilot)}
            rows.append(row)
            print(", ".join(f"{k}={row[k]}" for k in COLUMNS), file=sys.stderr, flush=True)
            if row["passed"]:
                break
    lines = [",".join(COLUMNS)] + [",".join(str(r[c]) for c in COLUMNS) for r in rows]
    write_text_atomic("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

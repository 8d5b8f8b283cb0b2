"""Cell throughput: one shared prefill per item against re-prefilling for every configuration.

Measured side by side in one run on the bundled SmolLM2 at ~1k tokens: a cell of 1 full + 2 policies ×
2 designs × 2 budgets × 3 seeds (Poisson seeds only, so 1 + 2·(1 + 3)·2 = 17 configurations), timed per
item (a) as kvcert-run does it (one prefill, every configuration decoded from it) and (b) re-prefilling
before every configuration. Items alternate between (a) and (b) so machine noise hits both alike.

    python benchmarks/cell_throughput.py [--items 4] [--context-tokens 1000] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcert import load_model
from kvcert.data import load_items
from kvcert.designs import DesignOptions
from kvcert.generation import decode, eos_ids, prefill, select
from kvcert.runner.cell import derive_seed, tokenize_item
from kvcert.runner.config import Grid

POLICIES = ("snapkv", "tova")
DESIGNS = ("topk", "poisson")
BUDGETS = (0.25, 0.5)
SEEDS = (0, 1, 2)


def configurations():
    return [("full", "full", 1.0, 0)] + [
        (c.policy, c.design, c.budget, c.seed) for c in Grid(POLICIES, DESIGNS, BUDGETS, SEEDS).configurations()
    ]


def run_item(model, tokenizer, item, shared: bool) -> float:
    prefix, suffix = tokenize_item(tokenizer, item, "question_aware", 1 << 30, "error", item.max_new_tokens)
    stop = eos_ids(model, tokenizer)
    start = time.perf_counter()
    state = prefill(model, prefix, suffix) if shared else None
    for policy, design, budget, seed in configurations():
        if not shared:
            state = prefill(model, prefix, suffix)
        selections = None if policy == "full" else select(
            state, policy, design, budget, derive_seed(seed, item.id), DesignOptions()
        )
        decode(model, state, selections, max_new_tokens=item.max_new_tokens, stop_ids=stop,
               certify=True, oracle=True, randomized=design == "poisson")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2")
    items = load_items("ruler", {"tasks": ["niah_multikey_2"], "context_tokens": args.context_tokens}, tokenizer,
                       args.items + 1)
    run_item(model, tokenizer, items[-1], shared=True)  # warm-up
    shared, separate = [], []
    for i, item in enumerate(items[:-1]):
        order = (True, False) if i % 2 == 0 else (False, True)
        for mode in order:
            (shared if mode else separate).append(run_item(model, tokenizer, item, mode))
    s, r = statistics.median(shared), statistics.median(separate)
    print(f"configurations per item: {len(configurations())}, context ~{args.context_tokens} tokens, "
          f"{args.items} items, {args.threads} threads")
    print(f"{'mode':<28}{'s/item (median)':>18}{'items/min':>12}")
    print(f"{'shared prefill (kvcert-run)':<28}{s:>18.2f}{60 / s:>12.2f}")
    print(f"{'re-prefill per configuration':<28}{r:>18.2f}{60 / r:>12.2f}")
    print(f"shared-prefill speed-up: {r / s:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()

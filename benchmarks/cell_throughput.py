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
from kvcert.generation import decode, decode_batch, eos_ids, prefill, select
from kvcert.generation import item_seed
from kvcert.runner.cell import batches, item_prompt
from kvcert.runner.config import Configuration, Grid

POLICIES = ("snapkv", "tova")
DESIGNS = ("topk", "poisson")
BUDGETS = (0.25, 0.5)
SEEDS = (0, 1, 2)


def configurations() -> list[Configuration]:
    return [Configuration("full", "full", 1.0, 0), *Grid(POLICIES, DESIGNS, BUDGETS, SEEDS).configurations()]


def _selections(state, conf, item):
    if conf.is_full:
        return None
    return select(state, conf.policy, conf.design, conf.budget, item_seed(conf.seed, item.id), DesignOptions())


def run_item(model, tokenizer, item, mode: str) -> float:
    prompt = item_prompt(tokenizer, item, "question_aware", 1 << 30, "error")
    prefix, suffix = prompt.prefix_ids, prompt.suffix_ids
    stop = eos_ids(model, tokenizer)
    options = {"max_new_tokens": item.max_new_tokens, "stop_ids": stop, "certify": True, "oracle": True}
    start = time.perf_counter()
    if mode == "batched":
        state = prefill(model, prefix, suffix)
        for group in batches(configurations()):
            decode_batch(model, state, [_selections(state, c, item) for c in group],
                         randomized=[c.design == "poisson" for c in group], **options)
    else:
        state = prefill(model, prefix, suffix)
        for conf in configurations():
            if mode == "re-prefill":
                state = prefill(model, prefix, suffix)
            decode(model, state, _selections(state, conf, item), randomized=conf.design == "poisson", **options)
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
    run_item(model, tokenizer, items[-1], "batched")  # warm-up
    modes = ["batched", "shared", "re-prefill"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i, item in enumerate(items[:-1]):
        for mode in modes[i % 3:] + modes[: i % 3]:
            times[mode].append(run_item(model, tokenizer, item, mode))
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"configurations per item: {len(configurations())}, context ~{args.context_tokens} tokens, "
          f"{args.items} items, {args.threads} threads")
    print(f"{'mode':<44}{'s/item (median)':>16}{'items/min':>11}")
    labels = {"batched": "shared prefill + batched decode (kvcert-run)", "shared": "shared prefill, one decode per config",
              "re-prefill": "re-prefill per configuration"}
    for m in modes:
        print(f"{labels[m]:<44}{med[m]:>16.2f}{60 / med[m]:>11.2f}")
    print(f"shared-prefill speed-up (re-prefill / shared): {med['re-prefill'] / med['shared']:.2f}x (target >= 2x)")
    print(f"kvcert-run speed-up (re-prefill / batched): {med['re-prefill'] / med['batched']:.2f}x")


if __name__ == "__main__":
    main()

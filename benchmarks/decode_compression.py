"""Exploratory, not pre-registered: compression during long generations (``max_cache_tokens``) on both bundled
models: is memory bounded, what does it cost in accuracy and agreement with the full cache, and does the
certificate, with the stages' compound inclusion probabilities, still cover the true attention-output error?

The task is a long generation whose every token needs the prompt: copy a passage of plain prose (about PASSAGE
sentences of ``kvcert.data.haystack``'s seeded prose, some 230 tokens) word for word, NEW_TOKENS generated greedily
with no stop token, so that the prompt and the answer together (about 490 tokens) are several times the bound.
Configurations per item: the full cache (the reference), and SnapKV at budget 0.5 at the prefill with the cache
then held under BOUND slots per layer and KV head (compressed again every INTERVAL tokens) with the Poisson design
(certificate, oracle on) and with top-k. Prompts are built as ``kvcert.generate`` builds them (question-aware),
decoded by ``kvcert.generation.decode_configurations`` (``kvcert.generate``'s decode path, here without a stop
token).

Per row (model, item, configuration): generated_tokens; peak_cache_tokens, the most slots any layer held after a
decode pass, read from the cache by a forward hook (not from the compressor's own count); decode_compressions
(layer compressions); copy_recall, the share of the passage's words the answer reproduces in order (difflib's
matching blocks; the task's accuracy); agreement, the share of generated tokens equal to the full cache's at the same step, and
first_divergence, the first step where they differ (NEW_TOKENS: never); for compressed runs with the oracle
coverage (share of (step, layer, KV head) with true error ≤ certificate), mean_rel_cert, mean_rel_err and
spearman (certificate vs true error over the same units); cpu_s. Written to OUT_ROWS (rewritten after each row, so
a stopped run keeps its finished rows) in OUT_DIR/rows_<model>.csv, and summarised per model and configuration
(means over items; every model's rows file present) in OUT_DIR/summary.csv.

    python benchmarks/decode_compression.py                   # both bundled models, one after the other
    python benchmarks/decode_compression.py --models gemma3   # one model (its rows file), then the summary
    python benchmarks/decode_compression.py --summary-only    # the summary of the rows files present

Sizes were fixed before any number was read: 2 items per model, NEW_TOKENS 256, BOUND 128 (about a quarter of
prompt plus answer), INTERVAL 16, one thread per process on the shared 2 cores.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import pandas as pd

MODELS = ("smollm2", "gemma3")
SEED = 6161  # the passages' seed (prose only: no study's items)
ITEMS = 2
PASSAGE = 14  # sentences per passage
NEW_TOKENS = 256
BOUND, INTERVAL = 128, 16
BUDGET = 0.5
OUT_DIR = Path("results/exploratory/decode-compression")  # rows_<model>.csv per model, summary.csv
CONFIGURATIONS = {  # name -> (policy, design, max_cache_tokens)
    "full": ("full", "full", None),
    "snapkv_poisson_bounded": ("snapkv", "poisson", BOUND),
    "snapkv_topk_bounded": ("snapkv", "topk", BOUND),
}
ROW_COLUMNS = ["model", "item", "configuration", "policy", "design", "budget", "max_cache_tokens",
               "compression_interval", "prompt_tokens", "generated_tokens", "peak_cache_tokens", "decode_compressions",
               "copy_recall", "agreement", "first_divergence", "coverage", "mean_rel_cert", "mean_rel_err",
               "spearman", "cpu_s"]


def passage(item: int) -> str:
    from kvcert.data.haystack import prose_sentences

    return " ".join(prose_sentences(random.Random(SEED + item), PASSAGE))


def copy_recall(text: str, reference: str) -> float:
    """Share of ``reference``'s words that ``text`` reproduces in order: the words of difflib's matching blocks
    between the two word sequences, over the reference's words."""
    from difflib import SequenceMatcher

    words, ref = text.split(), reference.split()
    blocks = SequenceMatcher(None, words, ref, autojunk=False).get_matching_blocks()
    return sum(block.size for block in blocks) / len(ref)


def run_model(name: str, items: int, new_tokens: int, done) -> None:
    import torch
    from scipy.stats import spearmanr
    from tqdm import tqdm

    import kvcert
    from kvcert.decode_compression import check_decode_bound
    from kvcert.generation import Configuration, decode_configurations
    from kvcert.policies import prefill_needs
    from kvcert.prompts import model_limit
    from kvcert.run_schema import DesignOptions

    model, tokenizer = kvcert.load_model(name)
    peaks: list[int] = []

    def slots(module, args, kwargs, output):
        ids = kwargs.get("input_ids")
        cache = kwargs.get("cache")
        if cache is not None and ids is not None and ids.shape[-1] == 1:  # a decode pass
            peaks.append(max(layer.filled for layer in cache.layers))

    handle = model.register_forward_hook(slots, with_kwargs=True)
    try:
        for item in range(items):
            text = passage(item)
            prompt = kvcert.build_prompt(tokenizer, f"Passage:\n{text}\n\n",
                                         "Repeat the passage above word for word.\n\nPassage:\n", "",
                                         max_new_tokens=new_tokens, limit=model_limit(model, None))
            state = kvcert.prefill(model, prompt.prefix_ids, prompt.suffix_ids, **prefill_needs(["snapkv"]))
            reference = None
            for conf_name, (policy, design, bound) in tqdm(CONFIGURATIONS.items(), desc=f"{name} item {item}",
                                                           unit="configuration"):
                peaks.clear()
                full = policy == "full"
                decode_bound = None if bound is None else check_decode_bound(
                    bound, INTERVAL, policy=policy, design=design, options=DesignOptions())
                start = time.process_time()
                out, = decode_configurations(
                    model, state, [Configuration(policy, design, 1.0 if full else BUDGET, 0)], item_id=f"copy-{item}",
                    max_new_tokens=new_tokens, stop_ids=set(), oracle=not full, decode_bound=decode_bound)
                cpu = time.process_time() - start
                answer = tokenizer.decode(out.token_ids, skip_special_tokens=True)
                if full:
                    reference = out.token_ids
                same = [a == b for a, b in zip(out.token_ids, reference)]
                steps = out.steps
                randomized = design == "poisson" and len(steps)
                row = {"model": name, "item": item, "configuration": conf_name, "policy": policy, "design": design,
                       "budget": 1.0 if full else BUDGET, "max_cache_tokens": bound,
                       "compression_interval": INTERVAL if bound else None,
                       "prompt_tokens": state.context_tokens, "generated_tokens": len(out.token_ids),
                       "peak_cache_tokens": max(peaks) if peaks else None,
                       "decode_compressions": out.decode_compressions, "copy_recall": copy_recall(answer, text),
                       "agreement": sum(same) / len(same), "first_divergence": next(
                           (i for i, s in enumerate(same) if not s), len(same)),
                       "coverage": float(steps["coverage"].mean()) if randomized else None,
                       "mean_rel_cert": float(steps["rel_cert"].mean()) if randomized else None,
                       "mean_rel_err": float(steps["rel_err"].mean()) if len(steps) else None,
                       "spearman": float(spearmanr(steps["cert"], steps["true_err"]).statistic) if randomized
                       else None, "cpu_s": round(cpu, 1)}
                done(row)
    finally:
        handle.remove()


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Means over items per model and configuration (peak: the largest), in the rows' order."""
    numeric = ["generated_tokens", "copy_recall", "agreement", "first_divergence", "decode_compressions",
               "coverage", "mean_rel_cert", "mean_rel_err", "spearman", "cpu_s"]
    keys = ["model", "configuration", "policy", "design", "budget", "max_cache_tokens", "compression_interval"]
    grouped = rows.groupby(keys, sort=False, dropna=False)
    table = grouped[numeric].mean()
    table.insert(0, "items", grouped.size())
    table.insert(2, "peak_cache_tokens", grouped["peak_cache_tokens"].max())
    table.insert(3, "prompt_tokens_mean", grouped["prompt_tokens"].mean())
    return table.reset_index().round(4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--items", type=int, default=ITEMS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="folder of the CSVs (written atomically)")
    parser.add_argument("--summary-only", action="store_true", help="run nothing: summarise the rows files present")
    args = parser.parse_args(argv)
    if args.items < 1 or args.new_tokens < 1:
        parser.error(f"--items={args.items} and --new-tokens={args.new_tokens} must be >= 1")
    import torch

    from kvcert.atomic import write_text_atomic

    torch.set_num_threads(1)
    if not args.summary_only:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in [] if args.summary_only else args.models:
        rows: list[dict] = []

        def write(row: dict, rows=rows, path=args.out_dir / f"rows_{name}.csv") -> None:
            rows.append(row)
            write_text_atomic(pd.DataFrame(rows, columns=ROW_COLUMNS).to_csv(index=False), path)

        run_model(name, args.items, args.new_tokens, write)
    files = [args.out_dir / f"rows_{name}.csv" for name in MODELS if (args.out_dir / f"rows_{name}.csv").is_file()]
    if not files:
        parser.error(f"no rows_<model>.csv in {args.out_dir}: nothing to summarise")
    table = summary(pd.concat([pd.read_csv(f) for f in files], ignore_index=True))
    write_text_atomic(table.to_csv(index=False), args.out_dir / "summary.csv")
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

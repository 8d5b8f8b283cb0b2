"""Peak memory of a certified decode against the same decode without the certificate, on the PyTorch path.

The path a GPU takes (bfloat16, or the compiled kernel off) computes the certificate inside each attention
call (``kvcert.estimator.hajek_with_variance``). This measures what that costs in memory on a Llama-shaped
stand-in (``kvcert.standins``: Llama-3.1-8B's architecture shrunk to 8 layers, 2 KV heads, head_dim 64,
random weights): a prompt of N tokens is prefilled once, then 9 rows of SnapKV Poisson at 25% (seeds 0-8)
decode 4 new tokens together, in the streaming setting (a 64-token question attends to the compressed
cache first) and the question-aware one, with ``KVCERT_KERNELS=0``, in float32 and bfloat16.

Each (dtype, tokens, setting) runs in fresh processes without and with the certificate (``certify``; no
oracle), one right after the other, so that both see the same machine; ``--repeats`` such pairs (the order
alternating) give the medians the table prints. Each process reports

* ``process peak``: its peak resident memory (VmHWM) over the whole run, prefill included;
* ``decode peak``: the peak above the resident memory just before the decode, the high-water mark reset
  after the prefill (``/proc/self/clear_refs``), so that the prefill's own peak cannot hide the decode's.

The table prints both, in MB (medians over the pairs), the ratio certified / uncertified of the medians and,
for the process peak, the range of the per-pair ratios: the allocator's reuse of freed memory moves a single
process's peak by a few percent from run to run, so one pair is not enough to read a 5% difference.

    python benchmarks/certificate_memory.py [--tokens 8192 16384] [--dtypes float32 bfloat16]
        [--settings streaming question_aware] [--rows 9] [--new-tokens 4] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

QUESTION_TOKENS = 64
VOCAB = 49152


def child(args: argparse.Namespace) -> dict:
    """One measured run in this process: build, prefill, reset the high-water mark, decode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import kvcert
    from kvcert.device_check import reset_peak_resident, resident_kb
    from kvcert.generation import decode_batch
    from kvcert.standins import MODELS, shrunk_config

    torch.set_num_threads(args.threads)
    fields = shrunk_config(MODELS["llama"], vocab_size=VOCAB, layers=8, kv_heads=2, head_dim=64)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    g = torch.Generator().manual_seed(1)
    streaming = args.setting == "streaming"
    n_prefix = args.tokens - (QUESTION_TOKENS if streaming else 0)
    prefix = torch.randint(10, VOCAB, (1, n_prefix), generator=g)
    question = torch.randint(10, VOCAB, (1, QUESTION_TOKENS), generator=g) if streaming else None
    state = kvcert.prefill(model, prefix, question, setting=args.setting)
    rows = [kvcert.select(state, "snapkv", "poisson", 0.25, seed=s) for s in range(args.rows)]
    reset_peak_resident()  # what follows is the decode's peak
    before = resident_kb("VmRSS")
    decoded = decode_batch(model, state, rows, max_new_tokens=args.new_tokens, certify=args.certify,
                                  oracle=False)
    decode_peak = resident_kb("VmHWM")
    import resource

    return {"dtype": args.dtype, "tokens": args.tokens, "setting": args.setting, "certify": args.certify,
            "process_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "decode_peak_mb": (decode_peak - before) / 1024, "before_decode_mb": before / 1024,
            "step_rows": int(sum(len(d.steps) for d in decoded)),
            "path": decoded[0].attention_path}


def measure(dtype: str, tokens: int, setting: str, certify: bool, opts: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--dtype", dtype, "--tokens", str(tokens), "--setting", setting,
           "--rows", str(opts.rows), "--new-tokens", str(opts.new_tokens), "--threads", str(opts.threads)]
    if certify:
        cmd.append("--certify")
    env = {**os.environ, "KVCERT_KERNELS": "0"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"certificate_memory: child {' '.join(cmd[2:])} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--settings", nargs="+", default=["streaming", "question_aware"])
    parser.add_argument("--rows", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="pairs per configuration (medians are printed)")
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--setting", default="streaming", help=argparse.SUPPRESS)
    parser.add_argument("--certify", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.tokens = args.tokens[0]
        print(json.dumps(child(args)))
        return 0
    rows = []
    print("| dtype | tokens | setting | process peak MB: no cert / cert / ratio [range] | "
          "decode peak MB: no cert / cert / ratio |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes:
        for tokens in args.tokens:
            for setting in args.settings:
                pairs = []
                for rep in range(args.repeats):
                    order = (False, True) if rep % 2 == 0 else (True, False)
                    runs = {certify: measure(dtype, tokens, setting, certify, args) for certify in order}
                    assert runs[True]["path"]["path"] == "pytorch", runs[True]["path"]
                    pairs.append((runs[False], runs[True]))
                    rows += [runs[False], runs[True]]
                med = lambda key, i: statistics.median(pair[i][key] for pair in pairs)  # noqa: E731
                p0, p1, d0, d1 = med("process_peak_mb", 0), med("process_peak_mb", 1), med("decode_peak_mb", 0), \
                    med("decode_peak_mb", 1)
                ratios = [cert["process_peak_mb"] / plain["process_peak_mb"] for plain, cert in pairs]
                print(f"| {dtype} | {tokens} | {setting} | {p0:.0f} / {p1:.0f} / {p1 / p0:.3f} "
                      f"[{min(ratios):.3f}, {max(ratios):.3f}] | {d0:.0f} / {d1:.0f} / {d1 / max(d0, 1.0):.3f} |",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

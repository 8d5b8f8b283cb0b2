"""Check the cost model of ``kvcert-plan`` against this machine, and measure what it is anchored by.

    python benchmarks/plan_check.py [--lengths 4000,8000,16000] [--settings streaming] [--out DIR]

1. Host overhead per layer and forward pass: greedy decode passes (``kvcert.Decoding``, the paper's
   configurations in one batch, oracle and certificates on) of tiny bfloat16 stand-ins with 2 and 8
   layers, whose matmuls cost next to nothing; the slope over layers is the per-layer overhead.
2. This CPU's rates at one thread: bfloat16 FLOP/s of a linear layer and copy bandwidth.
3. Real CPU cells (``kvcert-run``, the paper scale's grid, RULER niah_single, bfloat16) on a
   Llama-shaped stand-in at each length and a short baseline: peak RSS (``wait4``) against the cost
   model's peak (weights, caches, moments, oracle, transients; the baseline takes the process's own
   footprint: Python, torch, the tokenizer), and seconds per item against the model's time with the
   rates of step 2.

Prints markdown tables (README, "Paper scale"). Minutes on 2 cores; run it alone. With ``--out DIR`` the
stand-ins and finished cells are kept, and a rerun only recomputes the predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvcert import costs  # noqa: E402
from kvcert.plan import cell_plan, compose_cell  # noqa: E402
from kvcert.scales import load_scale, scales_folder  # noqa: E402
from kvcert.standins import build_model  # noqa: E402


def paper_grid_overrides() -> list[str]:
    scale = load_scale("paper", scales_folder(ROOT))
    return list(scale["grid"])


def host_overhead(tokenizer, workdir: Path, passes: int = 24) -> dict[str, float]:
    """Seconds per forward pass of tiny stand-ins with 2 and 8 layers, and the per-layer slope."""
    from kvcert import Decoding, prefill, select
    from kvcert.runner.cell import batches

    _, config = compose_cell(["model=smollm2", *paper_grid_overrides(), "setting=question_aware"])
    group = max(batches(config.configurations()), key=len)  # the largest batch (budget 0.25)
    torch.set_num_threads(1)
    times = {}
    for layers in (2, 8):
        path = build_model("llama", workdir / f"tiny{layers}", tokenizer, layers=layers, head_dim=8)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        ids = torch.randint(100, 1000, (1, 512))
        state = prefill(model, ids, setting="question_aware", accumulate=True)
        rows = [None if c.is_full else select(state, c.policy, c.design, c.budget, c.seed, config.options)
                for c in group]
        samples = []
        for _ in range(3):
            decoding = Decoding(model, state, rows, max_new_tokens=passes + 1, stop_ids=set(), oracle=True)
            start = time.perf_counter()
            n = 0
            while decoding.advance():
                n += 1
            decoding.results()
            samples.append((time.perf_counter() - start) / n)
        times[layers] = statistics.median(samples)
    per_layer = (times[8] - times[2]) / 6
    return {"pass_2_layers": times[2], "pass_8_layers": times[8], "per_layer": per_layer,
            "per_pass": times[2] - 2 * per_layer, "rows": len(group)}


def cpu_rates(repeats: int = 5) -> dict[str, float]:
    """bfloat16 FLOP/s of a linear layer (what a prefill mostly is) and copy bytes/s, one thread, warmed up."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x = torch.randn(2048, 512, dtype=torch.bfloat16)
    w = torch.randn(1792, 512, dtype=torch.bfloat16)
    big = torch.empty(64 * 1024 * 1024, dtype=torch.float32)
    copy = torch.empty_like(big)

    def median_seconds(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    flops = 2 * x.shape[0] * x.shape[1] * w.shape[0] / median_seconds(lambda: F.linear(x, w))
    bandwidth = 2 * big.numel() * 4 / median_seconds(lambda: copy.copy_(big))
    return {"bf16_flops": flops, "bandwidth": bandwidth}


def run_cell(model_dir: Path, tokens: int, setting: str, out: Path) -> dict:
    """One real cell; returns its peak RSS (bytes) and its manifest's timings."""
    overrides = ["model=hf", f"model.name={model_dir}", "model.dtype=bfloat16", "model.device=cpu", "data=ruler",
                 "data.tasks=[niah_single]", f"data.context_tokens={tokens}", "n_items=1",
                 *paper_grid_overrides(), f"setting={setting}", "threads=1", "progress=false", f"out_dir={out}"]
    script = shutil.which("kvcert-run")
    command = [script] if script else [sys.executable, "-m", "kvcert.runner.cli"]
    measured = out / "peak_rss.json"
    if not measured.is_file():  # --out keeps finished cells: a rerun recomputes only the predictions
        proc = subprocess.Popen(command + overrides, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        stderr = proc.stderr.read()
        if status != 0:
            raise RuntimeError(f"kvcert-run failed at {tokens} tokens: {stderr.strip().splitlines()[-1:]}")
        measured.write_text(json.dumps({"peak_rss": usage.ru_maxrss * 1024}))
    manifest = json.loads((out / "manifest.json").read_text())
    return {"peak_rss": json.loads(measured.read_text())["peak_rss"], "seconds": manifest["wall_seconds"]}


def predicted(model_dir: Path, tokens: int, setting: str, rates: dict, overhead: dict) -> tuple[dict, dict]:
    from transformers import AutoConfig

    from kvcert.plan import workload_prompts

    arch = costs.Architecture.from_config(AutoConfig.from_pretrained(model_dir))
    run_cfg, config = compose_cell(["model=hf", f"model.name={model_dir}", "model.dtype=bfloat16", "data=ruler",
                                    "data.tasks=[niah_single]", f"data.context_tokens={tokens}", "n_items=1",
                                    *paper_grid_overrides(), f"setting={setting}"])
    plan = cell_plan(config, run_cfg, "bfloat16", "cpu")
    (_, prompt), = workload_prompts(run_cfg["data"], setting, None)
    cpu = costs.Device("this CPU", 0, rates["bf16_flops"], rates["bandwidth"], 1.0, 1.0, overhead["per_layer"])
    return costs.peak_bytes(arch, prompt, "bfloat16", plan), costs.item_seconds(arch, prompt, "bfloat16", plan, cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4000,8000,16000")
    parser.add_argument("--baseline", type=int, default=256, help="prompt length whose RSS is the process baseline")
    parser.add_argument("--settings", default="streaming")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="keep the stand-ins and cells here")
    args = parser.parse_args()
    from kvcert.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    work = args.out or Path(tempfile.mkdtemp(prefix="kvcert-plan-check-"))
    work.mkdir(parents=True, exist_ok=True)
    overhead = host_overhead(tokenizer, work)
    rates = cpu_rates()
    print(f"host overhead per pass ({overhead['rows']} rows): 2 layers {overhead['pass_2_layers'] * 1e3:.1f} ms, "
          f"8 layers {overhead['pass_8_layers'] * 1e3:.1f} ms -> {overhead['per_layer'] * 1e3:.2f} ms per layer")
    print(f"this CPU, 1 thread: bf16 linear {rates['bf16_flops'] / 1e9:.1f} GFLOP/s, copy {rates['bandwidth'] / 1e9:.1f} GB/s")
    model_dir = work / "check-model"
    if not (model_dir / "config.json").is_file():
        build_model("llama", model_dir, tokenizer, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim)
    print()
    print("| setting | tokens | measured peak RSS (GB) | over baseline | predicted (model) | predicted over baseline "
          "| measured s/item | predicted s/item |")
    print("|---|---|---|---|---|---|---|---|")
    lengths = [int(x) for x in args.lengths.split(",")]
    for setting in args.settings.split(","):
        base = run_cell(model_dir, args.baseline, setting, work / f"cell-{setting}-{args.baseline}")
        base_peak, _ = predicted(model_dir, args.baseline, setting, rates, overhead)
        for tokens in lengths:
            got = run_cell(model_dir, tokens, setting, work / f"cell-{setting}-{tokens}")
            peak, secs = predicted(model_dir, tokens, setting, rates, overhead)
            measured_s = got["seconds"]["prefill"] + got["seconds"]["decode"]
            print(f"| {setting} | {tokens} | {got['peak_rss'] / 1e9:.2f} | {(got['peak_rss'] - base['peak_rss']) / 1e9:.2f} "
                  f"| {peak['total'] / 1e9:.2f} | {(peak['total'] - base_peak['total']) / 1e9:.2f} "
                  f"| {measured_s:.1f} | {secs['total']:.1f} |", flush=True)
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

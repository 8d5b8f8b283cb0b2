"""``kvcert-device-check``: the first command to run on a GPU node (or any new machine).

On the device it finds (cuda, else cpu) it loads the bundled SmolLM2 in the model dtype of the paper scale
(bfloat16 by default) and, beside it, the CPU float32 reference (the path every committed result comes from).
Both decode the same built-in pass-key prompts, in both settings, with the full cache, SnapKV top-k and SnapKV
Poisson at 25% (certificates and the oracle on). It then compares, one line per check with PASS or FAIL and
what to do on FAIL:

* tokens: the full cache's first generated tokens equal the reference's on most prompts;
* outputs: the log-probability of the reference's first token, device against reference;
* certificates: the median relative certificate of the Poisson rows, device over reference;
* coverage: the certificate's coverage (‖ô − o‖ ≤ ε̂) on the device against the reference's;
* error: the median relative attention-output error of Poisson rows, device over reference;
* overhead: d/c, the decode time per step with the certificate over the same decode without it, measured side
  by side on the device;
* memory: the decode's peak device memory (CUDA: ``max_memory_allocated`` above what the prefill left; CPU:
  the resident-set high-water mark above the memory before the decode) against ``kvcert.costs``' prediction
  for that shape.

The bounds are fixed per dtype below, from what each dtype's rounding allows (bfloat16 keeps 8 significant
bits): they are not fitted to any run. Exit status 0 when every line passes, 1 otherwise.

    kvcert-device-check [--model smollm2] [--dtype bfloat16] [--device auto] [--prompts 3] [--new-tokens 8]

``--model`` takes any model spec (``hf:<dir>`` for a local Hugging Face directory): on a machine that cannot
fetch the bundled SmolLM2, a stand-in built there (``python -m kvcert.standins``) checks the device path's
numerics, time and memory the same way, its random weights against their own float32 reference; only the
tokens line then means little (random logits are near ties, which bfloat16 reorders).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import costs
from .generation import Decoding, decode_batch, eos_ids, prefill, select
from .kernels import attention_path
from .models import ModelLoadError, ModelSpec, load_model
from .prompts import PromptIds, build_prompt
from .theory import passkey_prompt

PAPER_DTYPE = "bfloat16"  # the paper scale's model.dtype (configs/scales/paper.yaml; a test holds them equal)
BUDGET = 0.25
SETTINGS = ("question_aware", "streaming")


@dataclass(frozen=True)
class Bounds:
    """What a device run may differ from the CPU float32 reference by, per dtype."""

    token_agreement: float  # share of prompts × settings whose first 3 full-cache tokens equal the reference's
    logprob: float  # |Δ log p| of the reference's first token, in nats
    ratio: float  # device/reference of median relative certificate and error within [1/ratio, ratio]
    coverage: float  # |Δ coverage|
    overhead: float  # d/c at most: a gross regression, not the target (benchmarks/certificate_overhead.py)
    memory: float  # measured decode peak at most memory × predicted (+ 64 MB of allocator slack)


BOUNDS = {
    "float32": Bounds(token_agreement=1.0, logprob=1e-3, ratio=1.02, coverage=0.01, overhead=2.0, memory=1.5),
    "bfloat16": Bounds(token_agreement=0.66, logprob=0.25, ratio=1.25, coverage=0.03, overhead=2.0, memory=1.5),
    "float16": Bounds(token_agreement=0.66, logprob=0.1, ratio=1.15, coverage=0.03, overhead=2.0, memory=1.5),
}

ADVICE = {
    "tokens": "outputs diverge from float32 beyond rounding: check the attention implementation (kvcert.attach) "
              "and the model's dtype; run pytest tests/test_certificate_dtypes.py",
    "outputs": "logits differ beyond the dtype's rounding: check transformers' version and the model loading "
               "(kvcert-fetch-model model=smollm2 again)",
    "certificates": "the certificate's scale moved: run pytest tests/test_certificate_dtypes.py and "
                    "tests/test_estimator.py on this machine",
    "coverage": "certificate coverage differs from the reference: do not trust this device's certificates; "
                "report the table with the output of python -m torch.utils.collect_env",
    "error": "the estimator's error differs from the reference: check the retained sets (same seeds) and dtype",
    "overhead": "the certificate costs more time than it should: check that nothing else runs on the device; "
                "benchmarks/certificate_overhead.py measures it in detail",
    "memory": "the decode needs more memory than kvcert-plan predicts: size jobs from this measurement "
              "(workflow/profiles/slurm mem_mb / gpu) and report it",
}


@dataclass
class Run:
    """What one model produced on the prompts: per (prompt, setting) the full cache's tokens and first
    log-probabilities, and the Poisson rows' step tables."""

    tokens: list[list[int]]
    first_logprobs: list[np.ndarray]
    poisson_steps: list


def _prompts(tokenizer, count: int, new_tokens: int, device: str) -> list[tuple[str, PromptIds]]:
    """(setting, prompt ids on ``device``) for ``count`` pass-key prompts (about 600 tokens) in both settings."""
    out = []
    for seed in range(count):
        context, question, _ = passkey_prompt(n_noise=20, n_needles=2, seed=seed)
        for setting in SETTINGS:
            ids = build_prompt(tokenizer, context, question, setting=setting, max_new_tokens=new_tokens)
            out.append((setting, PromptIds(ids.prefix_ids.to(device), ids.suffix_ids.to(device), ids.truncated)))
    return out


def _decode_all(model, tokenizer, prompts, new_tokens: int) -> Run:
    run = Run([], [], [])
    stop = eos_ids(model, tokenizer)
    for setting, prompt in prompts:
        state = prefill(model, prompt.prefix_ids, prompt.suffix_ids, setting=setting)
        rows = [None, select(state, "snapkv", "topk", BUDGET), select(state, "snapkv", "poisson", BUDGET, seed=1)]
        full, _, poisson = decode_batch(model, state, rows, max_new_tokens=new_tokens, stop_ids=stop,
                                        certify=True, oracle=True)
        run.tokens.append(full.token_ids)
        run.first_logprobs.append(np.asarray(full.logprobs))
        run.poisson_steps.append(poisson.steps)
    return run


def _overhead(model, prompts, new_tokens: int, reps: int) -> float:
    """d/c: milliseconds per decode step of Poisson rows with the certificate over the same rows without it,
    the two decodings advanced pass by pass in turn (order swapped every pass), median over rounds."""
    ratios = []
    for setting, prompt in prompts[:2]:
        state = prefill(model, prompt.prefix_ids, prompt.suffix_ids, setting=setting)
        rows = [select(state, "snapkv", "poisson", BUDGET, seed=s) for s in range(3)]
        for _ in range(reps):
            spent = {True: 0.0, False: 0.0}
            decodings = {c: Decoding(model, state, rows, max_new_tokens=new_tokens, certify=c) for c in spent}
            live, turn = dict(decodings), 0
            while live:
                for certify in (list(live) if turn % 2 == 0 else list(live)[::-1]):
                    _sync(model)
                    start = time.perf_counter()
                    more = decodings[certify].advance()
                    _sync(model)
                    spent[certify] += time.perf_counter() - start
                    if not more:
                        del live[certify]
                turn += 1
            ratios.append(spent[True] / spent[False])
    return statistics.median(ratios)


def _sync(model) -> None:
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


def resident_kb(field: str) -> int | None:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process in kB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_resident() -> None:
    """Reset ``VmHWM`` to the resident memory now, so that it measures what follows (Linux; else a no-op)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _memory(model, prompt, setting: str, new_tokens: int) -> tuple[float | None, float]:
    """(measured, predicted) MB of the Poisson decode batch's peak above what was resident before it."""
    device = next(model.parameters()).device
    state = prefill(model, prompt.prefix_ids, prompt.suffix_ids, setting=setting)
    rows = [select(state, "snapkv", "poisson", BUDGET, seed=s) for s in range(3)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_resident()
        before = resident_kb("VmRSS")
    decode_batch(model, state, rows, max_new_tokens=new_tokens, certify=True, oracle=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        measured = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    else:
        peak = resident_kb("VmHWM")
        measured = None if peak is None or before is None else (peak - before) / 1024
    arch = costs.Architecture.from_config(model.config)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    plan = costs.CellPlan(batches=(costs.Batch(rows=len(rows), budget=BUDGET, randomized_rows=len(rows)),),
                          oracle=True, certify=True,
                          kernel_path=attention_path(getattr(torch, dtype), device).name != "pytorch")
    parts = costs.batch_bytes(arch, costs.Prompt(n=state.context_tokens, suffix=state.suffix_ids.shape[-1],
                                                 new_tokens=new_tokens), plan.batches[0], dtype, plan)
    return measured, sum(parts.values()) / 2**20


def _median(frames, column: str) -> float:
    values = np.concatenate([f[column].to_numpy(dtype=float) for f in frames])
    values = values[np.isfinite(values)]
    return float(np.median(values)) if values.size else float("nan")


def _coverage(frames) -> float:
    values = np.concatenate([f["coverage"].to_numpy(dtype=float) for f in frames])
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else float("nan")


def checks(device_run: Run, reference: Run, bounds: Bounds, overhead: float,
           memory: tuple[float | None, float]) -> list[tuple[str, str, str, str, bool]]:
    """(check, device value, reference value, bound, passed) per line of the table."""
    agree = [d[:3] == r[:3] for d, r in zip(device_run.tokens, reference.tokens)]
    share = sum(agree) / len(agree)
    first = max(abs(float(d[0]) - float(r[0])) for d, r in zip(device_run.first_logprobs, reference.first_logprobs)
                if d.size and r.size)
    lines = [("tokens", f"{share:.2f} of prompts agree", "1.00", f">= {bounds.token_agreement:.2f}",
              share >= bounds.token_agreement),
             ("outputs", f"max |Δ log p| {first:.2e}", "0", f"<= {bounds.logprob:g}", first <= bounds.logprob)]
    for name, column in (("certificates", "rel_cert"), ("error", "rel_err")):
        d, r = _median(device_run.poisson_steps, column), _median(reference.poisson_steps, column)
        ratio = d / r if r > 0 else float("nan")
        lines.append((name, f"median {d:.4g}", f"median {r:.4g}", f"ratio in [{1 / bounds.ratio:.2f}, {bounds.ratio}]",
                      bool(1 / bounds.ratio <= ratio <= bounds.ratio)))
    d, r = _coverage(device_run.poisson_steps), _coverage(reference.poisson_steps)
    lines.append(("coverage", f"{d:.3f}", f"{r:.3f}", f"|Δ| <= {bounds.coverage}", abs(d - r) <= bounds.coverage))
    lines.append(("overhead", f"d/c {overhead:.3f}", "-", f"<= {bounds.overhead}", overhead <= bounds.overhead))
    measured, predicted = memory
    if measured is None:
        lines.append(("memory", "not measurable here", f"{predicted:.0f} MB predicted", "-", True))
    else:
        lines.append(("memory", f"{measured:.0f} MB", f"{predicted:.0f} MB predicted",
                      f"<= {bounds.memory} x + 64 MB", measured <= bounds.memory * predicted + 64))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcert-device-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="model spec: smollm2 (default), gemma3, hf:<id or dir> (e.g. a stand-in), gguf:<file>")
    parser.add_argument("--dtype", default=PAPER_DTYPE, choices=sorted(BOUNDS))
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    parser.add_argument("--prompts", type=int, default=3, help="built-in pass-key prompts (each in both settings)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3, help="rounds of the side-by-side d/c timing")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 2 or args.reps < 1:
        parser.error("--prompts and --reps must be >= 1 and --new-tokens >= 2")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("kvcert-device-check: --device cuda, but torch sees no CUDA device "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})", file=sys.stderr)
        return 2
    try:
        spec = ModelSpec.parse(args.model)
        model, tokenizer = load_model(dataclasses.replace(spec, dtype=args.dtype, device=device))
        reference_model, _ = load_model(dataclasses.replace(spec, dtype="float32", device="cpu"))
    except ModelLoadError as err:
        print(f"kvcert-device-check: --model {args.model}: {err}", file=sys.stderr)
        return 2
    prompts = _prompts(tokenizer, args.prompts, args.new_tokens, device)
    reference_prompts = _prompts(tokenizer, args.prompts, args.new_tokens, "cpu")
    path = attention_path(getattr(torch, args.dtype), device)
    print(f"kvcert-device-check: {args.model} in {args.dtype} on {device} (certified attention: {path.name}"
          f"{', ' + path.reason if path.reason else ''}) against float32 on the CPU; {len(prompts)} prompts, "
          f"budget {BUDGET}", flush=True)
    device_run = _decode_all(model, tokenizer, prompts, args.new_tokens)
    reference = _decode_all(reference_model, tokenizer, reference_prompts, args.new_tokens)
    overhead = _overhead(model, prompts, args.new_tokens, args.reps)
    setting, prompt = prompts[-1]
    memory = _memory(model, prompt, setting, args.new_tokens)
    lines = checks(device_run, reference, BOUNDS[args.dtype], overhead, memory)
    width = max(len(line[1]) for line in lines)
    print(f"{'check':<13} {'device':<{width}}  {'reference':<22} {'bound':<24} result")
    for name, value, ref, bound, passed in lines:
        print(f"{name:<13} {value:<{width}}  {ref:<22} {bound:<24} {'PASS' if passed else 'FAIL'}")
    failed = [line[0] for line in lines if not line[4]]
    for name in failed:
        print(f"FAIL {name}: {ADVICE[name]}")
    print("kvcert-device-check: " + ("PASS" if not failed else f"FAIL ({', '.join(failed)})"))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())

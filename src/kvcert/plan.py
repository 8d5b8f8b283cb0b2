"""``kvcert-plan``: what a pipeline scale will cost, before anything is submitted.

    kvcert-plan scale=paper [--root .] [--json]

Expands the scale exactly as the Snakefile does (``kvcert.scales``), composes each cell's ``kvcert-run``
configuration as the runner would, and prints:

* jobs per rule, as the DAG itself lists them (a dry run of the workflow in a subprocess, every job forced, so
  that outputs already there do not hide any);
* per cell: the model, its prompt length, peak memory from the cost model (``kvcert.costs``: weights,
  the full cache, the largest compressed batch, the certificate's moments, the oracle's transients)
  and whether it fits 40, 80 and 141 GB GPUs;
* GPU-hours of the whole scale on A100, H100 and H200 from FLOPs and bytes per prefill and decode
  pass, with a host overhead per layer and pass measured on a CPU here.

Model configurations come from local directories, the Hugging Face cache or, for the paper's models,
the published architectures (``kvcert.architectures``): the plan needs neither network nor weights.
Generation lengths are the workloads' ``max_new_tokens`` (an upper bound: real models stop earlier).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .costs import GB, Architecture, Batch, CellPlan, Device, Prompt, item_seconds, peak_bytes
from .scales import ScaleError, cell_config, load_scale, scales_folder, study_cells

# Host work per layer and forward pass of a 9-row decode batch with oracle and certificates (Python,
# dispatch, the cache's bookkeeping): 2.0 ms measured with benchmarks/plan_check.py on the 2-core machine
# this was developed on, under load. A GPU does not shorten it: it is the floor of every pass however small
# its kernels, and it dominates decode time. A faster host lowers it (--host-overhead-ms).
HOST_OVERHEAD_PER_LAYER_PASS = 2.0e-3

# Nominal dense bf16 FLOP/s and memory bandwidth; eager PyTorch is assumed to reach 40% of the FLOPs and
# 60% of the bandwidth.
GPUS = (("A100-40GB", 40, 312e12, 1.555e12), ("A100-80GB", 80, 312e12, 2.039e12),
        ("H100-80GB", 80, 989e12, 3.35e12), ("H200-141GB", 141, 989e12, 4.8e12))


def devices(overhead: float = HOST_OVERHEAD_PER_LAYER_PASS) -> tuple[Device, ...]:
    return tuple(Device(name, memory, flops, bandwidth, 0.4, 0.6, overhead) for name, memory, flops, bandwidth in GPUS)
FIT_SIZES_GB = (40, 80, 141)
# What a CUDA context and the allocator's fragmentation take beyond the tensors.
GPU_RESERVE_GB = 2.0
# Question tokens fed after compression in the streaming setting (LongBench's templates put 20-100
# tokens after the document; RULER's questions are shorter).
QUESTION_TOKENS = {"longbench": 64, "ruler": 32, "jsonl": 48}
PAPER_GPU_HOURS = 70


@dataclass
class CellCost:
    cell: str
    model: str
    data: str
    setting: str
    shards: int
    items: int
    n: int
    dtype: str
    peak: dict[str, int]
    seconds_per_item: dict[str, float]  # device name -> seconds

    def fits(self, size_gb: float) -> bool:
        return self.peak["total"] + GPU_RESERVE_GB * GB <= size_gb * GB


# A cell is planned as its first shard composes it (the shard only picks the items).
_AS_PLANNED = ["out_dir=plan", "shard=0", "n_shards=1"]


def compose_cell(overrides: list[str]):
    """The cell's resolved kvcert-run config (as the runner composes it) and its validated CellConfig."""
    from .hydra_app import compose

    return _checked(compose([*overrides, *_AS_PLANNED]))


def _checked(cfg):
    from omegaconf import OmegaConf

    from .runner.config import validate

    plain = OmegaConf.to_container(cfg, resolve=True)
    return plain, validate(plain)


def workload_prompts(data: dict[str, Any], setting: str, cap: int | None) -> list[tuple[float, Prompt]]:
    """(weight, Prompt) per task of a workload: the prompt length it is cut to, its question, its answers."""
    name = data.get("name")
    question = QUESTION_TOKENS.get(name, 48)
    out: list[tuple[float, int, int]] = []
    if name == "longbench":
        from .data.longbench import DEFAULTS, subset_specs

        subsets = data.get("subsets") or DEFAULTS["subsets"]
        n = int(data.get("max_context_tokens") or 16000)
        specs = subset_specs()
        out = [(1.0 / len(subsets), n, int(specs[s[:-2] if s.endswith("_e") else s]["max_new_tokens"])) for s in subsets]
    elif name == "ruler":
        from random import Random

        from .data.ruler import BUILDERS, DEFAULTS, parse_task

        tasks = data.get("tasks") or DEFAULTS["tasks"]
        for entry in tasks:
            spec = parse_task(entry, data)
            draft = BUILDERS[spec.name](spec.knobs, Random(0))
            out.append((1.0 / len(tasks), int(spec.knobs["context_tokens"]), int(draft.max_new_tokens)))
    else:
        out = [(1.0, 4000, 32)]
    prompts = []
    for weight, n, new in out:
        if cap:
            n = min(n, cap - new)
        prefix = n if setting == "question_aware" else max(n - question, 1)
        prompts.append((weight, Prompt(n=prefix, suffix=0 if setting == "question_aware" else question, new_tokens=new)))
    return prompts


def cell_plan(config, run_cfg: dict[str, Any], dtype: str, device_type: str) -> CellPlan:
    """The batches a cell decodes (as kvcert.runner.cell.batches groups them) and what it records."""
    from .policies import prefill_needs
    from .runner.cell import batches

    groups = batches(config.configurations())
    opts = config.options
    return CellPlan(
        batches=tuple(Batch(rows=len(g), budget=g[0].budget if not g[0].is_full else 1.0,
                            randomized_rows=sum(c.design == "poisson" for c in g)) for g in groups),
        oracle=bool(config.oracle), certify=bool(config.certify),
        accumulate=prefill_needs(config.all_policies, config.policy_options)["accumulate"],
        head_fraction=opts.head_fraction, n_sink=opts.n_sink, n_recent=opts.n_recent, window=config.observation_window,
        kernel_path=dtype == "float32" and device_type == "cpu",
    )


def plan_jobs(name: str, root: Path) -> dict[str, int]:
    """Jobs per rule of scale ``name``'s DAG, most jobs first: ``snakemake --dry-run --forceall --quiet rules``
    run in ``root`` (the fetch rules and verify_preregistration included, whether or not their outputs exist)."""
    bin_dir = Path(sys.executable).parent
    snakemake = shutil.which("snakemake", path=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    if snakemake is None:
        raise LookupError("snakemake: not found beside this Python or on PATH; the plan reads the jobs from the DAG "
                          "(install the project's environment)")
    proc = subprocess.run([snakemake, "--dry-run", "--forceall", "--quiet", "rules", "--nolock", "--config",
                           f"scale={name}"], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise ValueError(f"scale={name}: the workflow's dry run failed: {lines[-1] if lines else proc.returncode}")
    stats = (proc.stdout + proc.stderr).split("Job stats:", 1)[-1].split("\ntotal", 1)[0]
    jobs = {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", stats, flags=re.M)}
    if not jobs:
        raise ValueError(f"scale={name}: the workflow's dry run listed no jobs")
    return dict(sorted(jobs.items(), key=lambda item: (-item[1], item[0])))


def plan_scale(name: str, root: Path, overhead: float = HOST_OVERHEAD_PER_LAYER_PASS) -> dict[str, Any]:
    from .architectures import model_config

    scale = load_scale(name, scales_folder(root))
    cells = {f"{study}/{cell}": spec for (study, cell), spec in study_cells(scale).items()}
    costs: list[CellCost] = []
    configs: dict[str, Any] = {}
    for cell_name, cell in cells.items():
        run_cfg, config = _checked(cell_config(scale, cell, _AS_PLANNED))
        model = run_cfg["model"]
        model_key = cell["model"]
        if model_key not in configs:
            configs[model_key] = Architecture.from_config(model_config(model))
        arch = configs[model_key]
        dtype = str(model.get("dtype", "float32"))
        device = str(model.get("device", "auto"))
        plan = cell_plan(config, run_cfg, dtype, "cpu" if device == "cpu" else "cuda")
        prompts = workload_prompts(run_cfg["data"], config.setting, config.max_context_tokens)
        peak = max((peak_bytes(arch, p, dtype, plan) for _, p in prompts), key=lambda d: d["total"])
        seconds = {d.name: sum(w * item_seconds(arch, p, dtype, plan, d)["total"] for w, p in prompts)
                   for d in devices(overhead)}
        costs.append(CellCost(cell_name, model_key, str(run_cfg["data"].get("name")), config.setting,
                              int(cell["shards"]), config.n_items, max(p.n + p.suffix for _, p in prompts),
                              dtype, peak, seconds))
    return {"scale": scale, "cells": costs, "jobs": plan_jobs(name, root), "architectures": configs,
            "overhead": overhead, "measured": measured_plan(root / str(scale["outdir"]) / "pilot" / "plan.json", name)}


def measured_plan(path: Path, name: str) -> dict[str, Any] | None:
    """The measured plan kvcert-pilot wrote for scale ``name`` (its plan.json), or None where there is none."""
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {**plan, "path": str(path)} if isinstance(plan, dict) and plan.get("scale") == name else None


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def render(result: dict[str, Any]) -> str:
    scale = result["scale"]
    costs: list[CellCost] = result["cells"]
    lines = [f"kvcert-plan: scale={scale['name']}" + (f" (derived from {scale['base']})" if scale.get("base") else "")]
    lines.append("")
    lines.append("jobs per rule: " + ", ".join(f"{k} {v}" for k, v in result["jobs"].items())
                 + f"; total {sum(result['jobs'].values())}")
    lines.append("")
    for key, arch in result["architectures"].items():
        lines.append(f"model {key}: {arch.parameters / 1e9:.2f}B parameters, {arch.layers} layers, "
                     f"{arch.heads} query / {arch.kv_heads} KV heads of {arch.head_dim}")
    lines.append("")
    lines.append("peak GPU memory per cell, GB (cost model; +%.0f GB CUDA reserve for the fit columns)" % GPU_RESERVE_GB)
    header = ["cell", "tokens", "weights", "full cache", "batch cache", "cert. moments", "oracle", "transients",
              "total"] + [f"{s}GB" for s in FIT_SIZES_GB]
    rows = []
    for c in costs:
        p = c.peak
        rows.append([c.cell, str(c.n), _gb(p["weights"]), _gb(p["full_cache"]), _gb(p["batch_cache"]),
                     _gb(p["certificate_moments"]), _gb(p["oracle_transients"]),
                     _gb(p["prefill_transients"] + p["decode_transients"]), _gb(p["total"])]
                    + ["yes" if c.fits(s) else "NO" for s in FIT_SIZES_GB])
    lines += _table(header, rows)
    lines.append("")
    lines.append("time (roofline per pass + %.1f ms host overhead per layer and pass; generation to max_new_tokens)"
                 % (result["overhead"] * 1e3))
    header = ["device", "s/item (mean)", "longest shard job (h)", "GPU-hours"]
    rows = []
    for d in devices(result["overhead"]):
        total = sum(c.seconds_per_item[d.name] * c.items for c in costs) / 3600
        per_item = sum(c.seconds_per_item[d.name] * c.items for c in costs) / max(sum(c.items for c in costs), 1)
        longest = max(c.seconds_per_item[d.name] * math.ceil(c.items / c.shards) for c in costs) / 3600
        rows.append([d.name, f"{per_item:.1f}", f"{longest:.2f}", f"{total:.0f}"])
    lines += _table(header, rows)
    if scale.get("claims_scale") == "paper" and scale["name"] == "paper":
        lines.append(f"the paper reports about {PAPER_GPU_HOURS} GPU-hours on one H100/H200 for its runs")
    return "\n".join(lines)


def render_measured(result: dict[str, Any]) -> str:
    """One paragraph on the measured plan beside the model's, where kvcert-pilot wrote one for the scale."""
    measured = result.get("measured")
    lines = []
    if measured:
        total, device = measured["total"], measured["device"]
        largest = max(measured["cells"].items(), key=lambda kv: kv[1]["gpu_memory_gb"])
        lines.append("")
        lines.append(f"measured (kvcert-pilot, {measured['path']}): on {device['name']} ({device['memory_gb']:.0f} GB), "
                     f"{total['device_hours']:.1f} device-hours with safety factor {measured['safety']:g}; longest cell "
                     f"job {total['longest_runtime_min']} min; most device memory {largest[1]['gpu_memory_gb']:.1f} GB "
                     f"({largest[0]}); rule cell takes each cell's runtime and memory from it")
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def as_json(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "scale": result["scale"]["name"], "jobs": result["jobs"],
        "cells": [{"cell": c.cell, "model": c.model, "tokens": c.n, "items": c.items, "shards": c.shards,
                   "peak_bytes": c.peak, "fits_gb": {str(s): c.fits(s) for s in FIT_SIZES_GB},
                   "seconds_per_item": c.seconds_per_item} for c in result["cells"]],
        "gpu_hours": {d.name: sum(c.seconds_per_item[d.name] * c.items for c in result["cells"]) / 3600
                      for d in devices(result["overhead"])},
        **({"measured": result["measured"]} if result.get("measured") else {}),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvcert-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("scale", help="scale=<name> (a file of configs/scales/)")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (holds configs/scales)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--host-overhead-ms", type=float, default=HOST_OVERHEAD_PER_LAYER_PASS * 1e3,
                        help="host time per layer and forward pass (default: measured on a 2-core machine)")
    args = parser.parse_args(argv)
    name = args.scale.split("=", 1)[1] if args.scale.startswith("scale=") else args.scale
    try:
        result = plan_scale(name, args.root, args.host_overhead_ms / 1e3)
    except (ScaleError, LookupError, ValueError, OSError) as err:
        print(f"kvcert-plan: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(result), indent=2) if args.json else render(result) + render_measured(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

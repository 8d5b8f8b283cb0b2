"""``kvcert-pilot``: measure a scale's cells on the node's own device, then plan the scale from the measurement.

    kvcert-pilot scale=paper [--items 2] [--safety 1.5] [--gpu-memory-gb 24] [--gpu-features 40=a100_40g,...]

``kvcert-plan`` prices a scale from a cost model; this runs it. For every cell kind of the scale (each cell of
its computed studies, a model x data x setting of a matrix, and each exploratory variant, as
``kvcert.scales.study_cells`` lists them) it runs ``kvcert-run`` in a child process with the cell's own overrides,
``--items`` items (shard 0 of 1) and a scratch ``out_dir``, exactly as rule ``cell`` would but for the item count,
and records:

* seconds per item: the mean time of ``run_item`` (the prefill and every configuration's decode of one item)
  over the items after the first, plus the cell's parquet writes per item; the first item's excess over that
  mean (CUDA context, kernel builds, caches) is the ``warmup``, charged once per shard;
* the model's load time and the data's load time, reported separately, also charged once per shard;
* peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS on a CPU (the peak RSS is
  recorded on a GPU too: it sizes the job's host memory; so is ``max_memory_reserved``, the allocator's pool, which
  the plan's reserve covers); the device's name and total memory.

From that table it writes a plan, per cell and in total (``safety`` is the stated factor, default 1.5):

* shard seconds = load_model + load_data + warmup + items per shard x seconds per item (measured);
* runtime (minutes, what SLURM is asked for per cell job) = ceil(safety x shard seconds / 60);
* device-hours = devices per cell x safety x (shards x (load_model + load_data + warmup) + items x seconds per
  item) / 3600, with devices per cell the scale's ``gpus_per_cell`` (at least 1);
* device memory needed = peak x ``memory_factor`` (default 1.2: items longer than the pilot's) + ``reserve_gb``
  (default 2, kvcert-plan's CUDA reserve); the smallest common card size that holds it; with ``--gpu-features``
  a SLURM constraint naming every card class that holds the largest cell (``-C 'a100_80g|h100_80g'``), the same
  for every cell, since a SLURM group runs several cells, chosen by Snakemake, on one GPU;
* host memory (MB) = the larger of the scale's ``resources.cell.mem_mb`` and peak RSS x ``memory_factor``.

``--reuse`` takes the kinds already measured in the scratch folder (same overrides, same code) instead of running
them again: a pilot that was stopped resumes, and ``--cells`` splits the measuring over several nodes (each writes
only its kinds' measurements; a last run with ``--reuse`` plans the whole scale).

A cell that needs more device memory than the card (``--gpu-memory-gb``, default the device's own) is refused:
one line naming the cell, what it needs and what the card has, exit 1, and nothing written. Otherwise
``<out>/pilot.csv`` (one row per cell kind), ``<out>/plan.json`` (what the workflow reads: rule ``cell`` takes
each cell's runtime, host memory and constraint from it when it exists) and ``<out>/plan.md`` (the measured
plan beside kvcert-plan's cost model) appear together in one rename. ``<out>`` defaults to
``<scale outdir>/pilot``; the cells' scratch outputs and logs go to ``<out>-scratch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

# Card sizes (GB) a plan names as the smallest that holds a cell.
MEMORY_CLASSES_GB = (16, 24, 32, 40, 48, 80, 94, 141, 192)
SAFETY = 1.5
MEMORY_FACTOR = 1.2
RESERVE_GB = 2.0
ITEMS = 2
GB = 1e9
PILOT_COLUMNS = ["kind", "study", "cell", "model", "items_run", "seconds_per_item", "first_item_s", "warmup_s",
                 "load_model_s", "load_data_s", "write_s", "peak_memory_gb", "memory_measure", "peak_rss_gb",
                 "peak_reserved_gb", "device", "device_name", "device_memory_gb"]


class PilotError(ValueError):
    """Bad input or a refused plan; the message is the one line the command prints."""


@dataclass(frozen=True)
class Measurement:
    """One cell kind run on the node: times in seconds, memory in GB (1e9 bytes)."""

    kind: str  # "<study>/<cell>"
    study: str
    cell: str
    model: str
    items_run: int
    seconds_per_item: float
    first_item_s: float
    warmup_s: float
    load_model_s: float
    load_data_s: float
    write_s: float
    peak_memory_gb: float  # max_memory_allocated on a GPU, peak RSS on a CPU
    memory_measure: str  # "cuda_max_memory_allocated" or "peak_rss"
    peak_rss_gb: float
    device: str  # as the cell's manifest states it: "cuda:0", "cpu"
    device_name: str
    device_memory_gb: float
    peak_reserved_gb: float | None = None  # max_memory_reserved on a GPU (the caching allocator's whole pool)

    @property
    def overhead_s(self) -> float:
        """What every shard pays once: loading the model and the data, and the first item's warm-up."""
        return self.load_model_s + self.load_data_s + self.warmup_s


def summarize(item_seconds: list[float], write_s: float) -> tuple[float, float]:
    """(seconds per item, warm-up) from the times of the items run in order, and the cell's write time.

    The first item pays the device's warm-up: with two or more items the mean of the others is the item time and
    the first item's excess over it the warm-up; with one item that item's time is the item time.
    """
    if not item_seconds:
        raise PilotError("no item ran")
    per_write = write_s / len(item_seconds)
    if len(item_seconds) == 1:
        return item_seconds[0] + per_write, 0.0
    steady = sum(item_seconds[1:]) / (len(item_seconds) - 1)
    return steady + per_write, max(item_seconds[0] - steady, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# The plan: pure arithmetic on measurements (no model, no device)


@dataclass(frozen=True)
class CellNeed:
    """What one cell of the scale needs, from the measurement of its kind."""

    cell: str
    shards: int
    items: int
    items_per_shard: int
    seconds_per_item: float
    overhead_s: float
    shard_seconds: float  # measured, without the safety factor
    runtime_min: int  # per cell job, with the safety factor
    device_hours: float  # with the safety factor
    devices: int
    memory_gb: float  # device memory needed: peak x memory_factor + reserve
    memory_class_gb: int | None  # smallest card size that holds it (None: larger than every class)
    mem_mb: int  # host memory per cell job
    constraint: str | None


def parse_features(text: str | None) -> dict[int, str]:
    """``--gpu-features '40=a100_40g,80=a100_80g|h100_80g'`` as {card GB: SLURM feature expression}."""
    out: dict[int, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        size, sep, feature = part.partition("=")
        try:
            gb = int(size)
        except ValueError:
            gb = 0
        if not sep or gb <= 0 or not feature.strip():
            raise PilotError(f"--gpu-features: {part.strip()!r}: expected <card GB>=<SLURM feature>, "
                             "e.g. 40=a100_40g,80=a100_80g|h100_80g")
        out[gb] = feature.strip()
    return dict(sorted(out.items()))


def plan_cells(measured: Mapping[str, Measurement], cells: Mapping[str, Mapping[str, Any]], *,
               safety: float = SAFETY, memory_factor: float = MEMORY_FACTOR, reserve_gb: float = RESERVE_GB,
               card_gb: float, devices_per_cell: int = 1, host_mem_mb: int = 0,
               features: Mapping[int, str] | None = None) -> list[CellNeed]:
    """Each cell's need from its kind's measurement.

    cells: cell name -> {"kind": measured kind, "shards": n, "items": n}. Refuses (PilotError, one line) a cell
    whose device memory need exceeds ``card_gb``, naming it, its need and the card; the rest are named by count.
    """
    if safety < 1 or memory_factor < 1 or reserve_gb < 0:
        raise PilotError(f"--safety {safety}, --memory-factor {memory_factor}, --reserve-gb {reserve_gb}: "
                         "the factors must be at least 1 and the reserve at least 0")
    needs, too_big = [], []
    for name, cell in cells.items():
        m = measured[cell["kind"]]
        shards, items = int(cell["shards"]), int(cell["items"])
        per_shard = math.ceil(items / shards)
        shard_seconds = m.overhead_s + per_shard * m.seconds_per_item
        hours = devices_per_cell * safety * (shards * m.overhead_s + items * m.seconds_per_item) / 3600
        memory = m.peak_memory_gb * memory_factor + reserve_gb
        fitting = [gb for gb in MEMORY_CLASSES_GB if gb >= memory]
        needs.append(CellNeed(
            cell=name, shards=shards, items=items, items_per_shard=per_shard, seconds_per_item=m.seconds_per_item,
            overhead_s=m.overhead_s, shard_seconds=shard_seconds,
            runtime_min=max(1, math.ceil(safety * shard_seconds / 60)), device_hours=hours, devices=devices_per_cell,
            memory_gb=memory, memory_class_gb=fitting[0] if fitting else None,
            mem_mb=max(int(host_mem_mb), math.ceil(m.peak_rss_gb * memory_factor * 1000)), constraint=None))
        if memory > card_gb:
            too_big.append((name, m, memory))
    if too_big:
        name, m, memory = too_big[0]
        more = f"; {len(too_big) - 1} more cells do not fit either" if len(too_big) > 1 else ""
        raise PilotError(f"cell {name} needs {memory:.1f} GB of device memory (measured peak {m.peak_memory_gb:.2f} GB "
                         f"x {memory_factor:g} + {reserve_gb:g} GB reserve) but the card has {card_gb:.1f} GB{more}; "
                         "run it on a larger card (--gpu-memory-gb states the card)")
    if features:
        # One constraint for every cell: a SLURM group runs several cells on one GPU, and which cells share a
        # group is Snakemake's choice, so every GPU must hold the largest cell.
        largest = max(needs, key=lambda n: n.memory_gb)
        holds = [feature for gb, feature in features.items() if gb >= largest.memory_gb]
        if not holds:
            raise PilotError(f"cell {largest.cell} needs {largest.memory_gb:.1f} GB of device memory; no card of "
                             f"--gpu-features ({', '.join(f'{gb} GB' for gb in features)}) holds it")
        needs = [dataclasses.replace(n, constraint="|".join(holds)) for n in needs]
    return needs


def totals(needs: list[CellNeed]) -> dict[str, float]:
    return {"device_hours": sum(n.device_hours for n in needs),
            "longest_runtime_min": max((n.runtime_min for n in needs), default=0),
            "cell_jobs": sum(n.shards for n in needs),
            "items": sum(n.items for n in needs)}


# ---------------------------------------------------------------------------------------------------------------
# The scale's cell kinds


def scale_kinds(name: str, root: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(scale, {"<study>/<cell>": {"study", "cell", "model", "shards", "items", "overrides"}}) for every cell the
    scale runs; each is its own kind (its overrides differ from every other's)."""
    from .plan import _checked
    from .scales import ScaleError, cell_config, cell_overrides, load_scale, scales_folder, study_cells

    try:
        scale = load_scale(name, scales_folder(root))
        found = study_cells(scale)
    except ScaleError as err:
        raise PilotError(str(err)) from None
    kinds = {}
    for (study, cell), spec in found.items():
        _, config = _checked(cell_config(scale, spec, ["out_dir=plan", "shard=0", "n_shards=1"]))
        if config.n_items is None:
            raise PilotError(f"scale={name}: cell {study}/{cell}: n_items is not set (every item of its data); "
                             "the plan needs an item count")
        kinds[f"{study}/{cell}"] = {"study": study, "cell": cell, "model": spec["model"], "shards": int(spec["shards"]),
                                    "items": int(config.n_items), "overrides": cell_overrides(scale, spec)}
    if not kinds:
        raise PilotError(f"scale={name}: runs no cells (every study is archived or reads another's cells)")
    return scale, kinds


def pilot_overrides(kind: Mapping[str, Any], scale: Mapping[str, Any], items: int, out_dir: Path,
                    longbench: Path) -> list[str]:
    """The kvcert-run overrides of a kind's pilot run: the cell's own (pointed at the local LongBench copy where it
    reads the hub's, as rule cell does), then the pilot's item count, shard and scratch out_dir."""
    from .scales import parse_overrides

    overrides = list(kind["overrides"])
    values = parse_overrides(overrides)
    if values.get("data") == "longbench" and values.get("data.path") is None:
        if not (longbench.is_dir() and any(longbench.iterdir())):
            raise PilotError(f"cell {kind['study']}/{kind['cell']} reads LongBench from the hub: no local copy at "
                             f"{longbench} (fetch it where the network is: snakemake --cores 1 --config "
                             f"scale={scale.get('name', '?')} {scale.get('outdir', '<outdir>')}/data/longbench; "
                             "or pass --longbench DIR)")
        overrides.append(f"data.path={longbench}")
    threads = int(scale.get("threads_per_cell", 1))
    return [*overrides, f"n_items={items}", "shard=0", "n_shards=1", f"threads={threads}", f"out_dir={out_dir}"]


# ---------------------------------------------------------------------------------------------------------------
# Measuring one kind: a child process runs kvcert-run's own main with a timer around run_item


def _device_facts(device: str) -> tuple[str, float]:
    """(name, total memory in GB) of the device a cell ran on ("cuda:0", "cpu")."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        return torch.cuda.get_device_name(index), torch.cuda.get_device_properties(index).total_memory / GB
    from .provenance import cpu_model

    return cpu_model() or "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def _child(result: Path, overrides: list[str]) -> int:
    """Run one cell (kvcert-run's main, unchanged) and write what it measured to ``result`` (JSON)."""
    import resource

    import torch

    from .atomic import write_json_atomic
    from .runner import cell as cell_module
    from .runner import cli

    times: list[float] = []
    run_item = cell_module.run_item

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = run_item(*args, **kwargs)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        return out

    cell_module.run_item = timed  # the runner looks run_item up in its module at each item
    code = cli.main(overrides)
    if code != 0:
        return code
    out_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("out_dir=")))
    manifest = json.loads((out_dir / "manifest.json").read_text())
    device = str(manifest["device"])
    name, total = _device_facts(device)
    on_gpu = device.startswith("cuda")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # Linux: kilobytes
    ran = int(manifest["n_shard_items"]) - int(manifest.get("n_resumed_items", 0))
    if len(times) != ran:  # the runner no longer calls run_item per item: its manifest's sums, spread evenly
        wall = manifest["wall_seconds"]
        times = [(float(wall.get("prefill", 0.0)) + float(wall.get("decode", 0.0))) / max(ran, 1)] * ran
    write_json_atomic({
        "item_seconds": times, "wall_seconds": manifest["wall_seconds"], "device": device, "dtype": manifest["dtype"],
        "device_name": name, "device_memory_gb": total, "peak_rss_gb": rss,
        "peak_memory_gb": torch.cuda.max_memory_allocated(torch.device(device)) / GB if on_gpu else rss,
        "peak_reserved_gb": torch.cuda.max_memory_reserved(torch.device(device)) / GB if on_gpu else None,
        "memory_measure": "cuda_max_memory_allocated" if on_gpu else "peak_rss",
        "code_fingerprint": manifest["code_fingerprint"], "overrides": overrides,
    }, result)
    return 0


def measure(key: str, kind: Mapping[str, Any], overrides: list[str], scratch: Path, reuse: bool,
            root: Path = Path(".")) -> Measurement:
    """Run kind ``key`` in a child process in ``root`` (or read its earlier run with ``reuse``) and return what it
    measured."""
    import shutil

    where = scratch / key
    result = where / "measure.json"
    found = json.loads(result.read_text()) if reuse and result.is_file() else None
    if found is not None:
        from .provenance import code_fingerprint

        if found.get("overrides") != overrides or found.get("code_fingerprint") != code_fingerprint():
            found = None  # another configuration or code: measure again
    if found is None:
        if where.exists():
            shutil.rmtree(where)
        where.mkdir(parents=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        log = where / "run.log"
        with log.open("w") as handle:
            proc = subprocess.run([sys.executable, "-m", "kvcert.device_pilot", "--child", str(result), "--",
                                   *overrides], stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=root)
        if proc.returncode != 0 or not result.is_file():
            lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit {proc.returncode}"
            if "out of memory" in last.lower():
                last = f"ran out of device memory ({last})"
            raise PilotError(f"cell {key}: the pilot run failed: {last} (log: {log})")
        found = json.loads(result.read_text())
    wall = found["wall_seconds"]
    per_item, warmup = summarize(found["item_seconds"], float(wall.get("write", 0.0)))
    return Measurement(
        kind=key, study=kind["study"], cell=kind["cell"], model=kind["model"], items_run=len(found["item_seconds"]),
        seconds_per_item=per_item, first_item_s=found["item_seconds"][0], warmup_s=warmup,
        load_model_s=float(wall.get("load_model", 0.0)), load_data_s=float(wall.get("load_data", 0.0)),
        write_s=float(wall.get("write", 0.0)), peak_memory_gb=float(found["peak_memory_gb"]),
        memory_measure=found["memory_measure"], peak_rss_gb=float(found["peak_rss_gb"]), device=found["device"],
        device_name=found["device_name"], device_memory_gb=float(found["device_memory_gb"]),
        peak_reserved_gb=found.get("peak_reserved_gb"))


# ---------------------------------------------------------------------------------------------------------------
# The cost model beside the measurement (kvcert-plan's numbers for the same cells)


def modelled(scale: Mapping[str, Any], kinds: Mapping[str, Mapping[str, Any]], device_name: str) -> dict[str, dict]:
    """{kind: {"device", "seconds_per_item", "peak_gb"}} from kvcert-plan's cost model, on the model's device whose
    name the measured device's resembles (H100 when none does); {} where the model has no architecture."""
    from .architectures import model_config
    from .costs import Architecture, item_seconds, peak_bytes
    from .plan import _checked, cell_plan, devices, workload_prompts
    from .scales import cell_config, study_cells

    cells = study_cells(scale)
    choices = devices()
    label = device_name.upper().replace(" ", "")
    device = next((d for d in choices if d.name.split("-")[0] in label and d.name.split("-")[1][:-2] in label), None) \
        or next((d for d in choices if d.name.split("-")[0] in label), None) or choices[2]
    out, archs = {}, {}
    for key, kind in kinds.items():
        try:
            spec = cells[(kind["study"], kind["cell"])]
            run_cfg, config = _checked(cell_config(scale, spec, ["out_dir=plan", "shard=0", "n_shards=1"]))
            model = run_cfg["model"]
            if kind["model"] not in archs:
                archs[kind["model"]] = Architecture.from_config(model_config(model))
            arch = archs[kind["model"]]
            dtype = str(model.get("dtype", "float32"))
            plan = cell_plan(config, run_cfg, dtype, "cpu" if str(model.get("device")) == "cpu" else "cuda")
            prompts = workload_prompts(run_cfg["data"], config.setting, config.max_context_tokens)
            out[key] = {"device": device.name,
                        "seconds_per_item": sum(w * item_seconds(arch, p, dtype, plan, device)["total"]
                                                for w, p in prompts),
                        "peak_gb": max(peak_bytes(arch, p, dtype, plan)["total"] for _, p in prompts) / GB}
        except Exception as err:  # noqa: BLE001 - a model the cost model cannot read: the measurement stands alone
            print(f"kvcert-pilot: no cost model for {key} ({type(err).__name__}: {' '.join(str(err).split())[:200]})",
                  file=sys.stderr)
            continue
    return out


# ---------------------------------------------------------------------------------------------------------------
# Writing


def plan_payload(scale_name: str, measured: Mapping[str, Measurement], needs: list[CellNeed], settings: dict) -> dict:
    first = next(iter(measured.values()))
    return {
        "scale": scale_name,
        "device": {"name": first.device_name, "memory_gb": round(first.device_memory_gb, 3), "device": first.device},
        **settings,
        "cells": {n.cell: {"runtime": n.runtime_min, "mem_mb": n.mem_mb, "gpu_memory_gb": round(n.memory_gb, 3),
                           "gpu_memory_class_gb": n.memory_class_gb,
                           **({"constraint": n.constraint} if n.constraint else {}),
                           "shards": n.shards, "items": n.items, "items_per_shard": n.items_per_shard,
                           "seconds_per_item": round(n.seconds_per_item, 6), "overhead_s": round(n.overhead_s, 6),
                           "shard_seconds": round(n.shard_seconds, 6), "device_hours": round(n.device_hours, 6)}
                  for n in needs},
        "total": {k: round(v, 6) if isinstance(v, float) else v for k, v in totals(needs).items()},
    }


def render(payload: dict, measured: Mapping[str, Measurement], model: Mapping[str, dict]) -> str:
    from .plan import _table

    s = payload
    lines = [f"# Measured plan: scale={s['scale']}", "",
             f"Measured by `kvcert-pilot` on {s['device']['name']} ({s['device']['memory_gb']:.1f} GB, "
             f"{s['device']['device']}), {s['items']} items per cell kind; planned for a card of "
             f"{s['card_gb']:.1f} GB.", "",
             f"- shard seconds = load_model + load_data + warmup + items per shard x seconds per item",
             f"- runtime per cell job (min) = ceil({s['safety']:g} x shard seconds / 60)",
             f"- device-hours = {s['devices_per_cell']} x {s['safety']:g} x (shards x (load_model + load_data + warmup)"
             " + items x seconds per item) / 3600",
             f"- device memory = peak x {s['memory_factor']:g} + {s['reserve_gb']:g} GB"
             f" (peak: {next(iter(measured.values())).memory_measure})", "",
             "## Per cell kind, measured beside the cost model (kvcert-plan)", "", "```"]
    header = ["cell", "s/item", "model s/item", "warmup s", "load model s", "load data s", "peak GB", "model GB",
              "peak RSS GB"]
    rows = []
    on_gpu = s["device"]["device"].startswith("cuda")
    for key, m in measured.items():
        c = model.get(key, {})
        rows.append([key, f"{m.seconds_per_item:.3f}", f"{c['seconds_per_item']:.3f}" if c and on_gpu else "-",
                     f"{m.warmup_s:.2f}",
                     f"{m.load_model_s:.2f}", f"{m.load_data_s:.2f}", f"{m.peak_memory_gb:.2f}",
                     f"{c['peak_gb']:.2f}" if c else "-", f"{m.peak_rss_gb:.2f}"])
    lines += _table(header, rows)
    if model and on_gpu:
        lines.append(f"(model columns: kvcert-plan's cost model on {next(iter(model.values()))['device']})")
    elif model:
        lines.append("(model GB: kvcert-plan's cost model of the cell's tensors; on a CPU the peak is the whole "
                     "process's RSS, and the cost model prices no CPU time)")
    lines += ["```", "", "## Per cell (what rule cell asks for)", "", "```"]
    header = ["cell", "shards", "items/shard", "shard s", "runtime min", "device-h", "memory GB", "card class GB",
              "host mem MB", "constraint"]
    rows = [[name, str(c["shards"]), str(c["items_per_shard"]), f"{c['shard_seconds']:.0f}", str(c["runtime"]),
             f"{c['device_hours']:.2f}", f"{c['gpu_memory_gb']:.1f}", str(c["gpu_memory_class_gb"] or ">192"),
             str(c["mem_mb"]), c.get("constraint", "-")] for name, c in s["cells"].items()]
    lines += _table(header, rows)
    t = s["total"]
    lines += ["```", "", f"Total: {t['device_hours']:.2f} device-hours over {t['cell_jobs']} cell jobs "
              f"({t['items']} items); the longest cell job asks for {t['longest_runtime_min']} min.", ""]
    return "\n".join(lines)


def write_outputs(out: Path, measured: Mapping[str, Measurement], payload: dict, text: str) -> None:
    """pilot.csv, plan.json and plan.md into ``out``, all three in one rename."""
    import pandas as pd

    from .atomic import new_directory

    frame = pd.DataFrame([asdict(m) for m in measured.values()])[PILOT_COLUMNS]
    with new_directory(out, replace=True) as tmp:
        frame.to_csv(tmp / "pilot.csv", index=False)
        (tmp / "plan.json").write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
        (tmp / "plan.md").write_text(text)


def read_plan(path: str | Path, scale_name: str, cells: list[str]) -> dict[str, dict]:
    """The per-cell resources of a plan written by kvcert-pilot, checked against the scale that reads it.

    Returns {"<study>/<cell>": {"runtime", "mem_mb", "constraint"?}}; raises PilotError (one line) for a plan of
    another scale or one that lacks a cell of ``cells``.
    """
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PilotError(f"{path}: not a readable plan ({err})") from None
    if plan.get("scale") != scale_name:
        raise PilotError(f"{path}: a plan of scale={plan.get('scale')}, not of scale={scale_name}; rerun "
                         f"kvcert-pilot scale={scale_name} or remove it")
    missing = [c for c in cells if c not in (plan.get("cells") or {})]
    if missing:
        raise PilotError(f"{path}: has no cell {missing[0]} of scale={scale_name} (the scale changed since the pilot); "
                         f"rerun kvcert-pilot scale={scale_name} or remove it")
    return {c: {k: plan["cells"][c][k] for k in ("runtime", "mem_mb", "constraint") if k in plan["cells"][c]}
            for c in cells}


# ---------------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> Path | None:
    from tqdm.auto import tqdm

    name = args.scale.split("=", 1)[1] if args.scale.startswith("scale=") else args.scale
    root = args.root
    scale, kinds = scale_kinds(name, root)
    if args.cells:
        import fnmatch

        kinds = {k: v for k, v in kinds.items() if any(fnmatch.fnmatch(k, p) for p in args.cells.split(","))}
        if not kinds:
            raise PilotError(f"--cells {args.cells}: matches no cell of scale={name}")
    out = (args.out or root / str(scale["outdir"]) / "pilot").resolve()
    scratch = out.with_name(out.name + "-scratch")
    longbench = (args.longbench or root / str(scale["outdir"]) / "data" / "longbench").resolve()
    features = parse_features(args.gpu_features)
    if args.items < 1:
        raise PilotError(f"--items {args.items}: run at least one item per cell kind")
    measured: dict[str, Measurement] = {}
    bar = tqdm(kinds.items(), desc="pilot", unit="kind", file=sys.stderr, dynamic_ncols=True)
    for key, kind in bar:
        bar.set_postfix_str(key)
        overrides = pilot_overrides(kind, scale, args.items, (scratch / key / "cell").resolve(), longbench)
        measured[key] = m = measure(key, kind, overrides, scratch, args.reuse, root)
        bar.write(f"kvcert-pilot: {key}: {m.seconds_per_item:.3f} s/item (first {m.first_item_s:.2f} s), "
                  f"load {m.load_model_s:.1f} s, peak {m.peak_memory_gb:.2f} GB on {m.device}", file=sys.stderr)
    bar.close()
    if args.cells:  # a part of the scale: its measurements stay in the scratch folder for a later --reuse
        return None
    first = next(iter(measured.values()))
    card = args.gpu_memory_gb if args.gpu_memory_gb is not None else first.device_memory_gb
    host = int(((scale.get("resources") or {}).get("cell") or {}).get("mem_mb", 0))
    devices_per_cell = max(int(scale.get("gpus_per_cell", 0)), 1)
    cells = {key: {"kind": key, "shards": kind["shards"], "items": kind["items"]} for key, kind in kinds.items()}
    needs = plan_cells(measured, cells, safety=args.safety, memory_factor=args.memory_factor,
                       reserve_gb=args.reserve_gb, card_gb=card, devices_per_cell=devices_per_cell, host_mem_mb=host,
                       features=features)
    settings = {"items": args.items, "card_gb": card, "safety": args.safety, "memory_factor": args.memory_factor,
                "reserve_gb": args.reserve_gb, "devices_per_cell": devices_per_cell}
    payload = plan_payload(name, measured, needs, settings)
    write_outputs(out, measured, payload, render(payload, measured, modelled(scale, kinds, first.device_name)))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child(Path(argv[1]), argv[3:] if argv[2:3] == ["--"] else argv[2:])
    parser = argparse.ArgumentParser(prog="kvcert-pilot", description=__doc__.split("\n\n")[0])
    parser.add_argument("scale", help="scale=<name> (a file of configs/scales/)")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (holds configs/scales)")
    parser.add_argument("--items", type=int, default=ITEMS, help=f"items per cell kind (default {ITEMS})")
    parser.add_argument("--safety", type=float, default=SAFETY, help=f"factor on measured times (default {SAFETY})")
    parser.add_argument("--memory-factor", type=float, default=MEMORY_FACTOR,
                        help=f"factor on measured peak memory (default {MEMORY_FACTOR})")
    parser.add_argument("--reserve-gb", type=float, default=RESERVE_GB,
                        help=f"device memory beyond the tensors: CUDA context, fragmentation (default {RESERVE_GB})")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="memory of the cards the scale will run on (default: this device's own)")
    parser.add_argument("--gpu-features", default=None,
                        help="card GB=SLURM feature, comma-separated (e.g. 40=a100_40g,80=a100_80g|h100_80g): "
                             "each cell's constraint names every class that holds it")
    parser.add_argument("--cells", default=None,
                        help="measure only these cells (comma-separated globs of <study>/<cell>), e.g. on several "
                             "nodes at once; no plan is written: plan the scale afterwards with --reuse")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default <scale outdir>/pilot)")
    parser.add_argument("--longbench", type=Path, default=None,
                        help="local LongBench copy for hub-reading cells (default <scale outdir>/data/longbench)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse kinds already measured in the scratch folder (same overrides and code)")
    args = parser.parse_args(argv)
    # The pilot reads models and data the node already holds, as the cells it measures do: never the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        out = run(args)
    except PilotError as err:
        print(f"kvcert-pilot: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:
        print(f"kvcert-pilot: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if out is None:
        print(f"kvcert-pilot: measured the cells of --cells {args.cells}; plan the whole scale with "
              f"kvcert-pilot {args.scale} --reuse (it measures only the kinds not measured yet)", file=sys.stderr)
        return 0
    print(f"kvcert-pilot: wrote {out}/pilot.csv, {out}/plan.json and {out}/plan.md", file=sys.stderr)
    print((out / "plan.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

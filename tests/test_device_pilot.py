"""kvcert-pilot: the measured plan's arithmetic, its refusal of a cell that does not fit the card, the workflow
reading the plan, and (marker ``cluster``) the pilot itself over a small scale of random-weight stand-ins on
this CPU, through kvcert-run as a real cell runs.

The fast tests give the plan hand-made measurements: they are about kvcert's own arithmetic and its refusals,
not about what a device measures.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvcert import device_pilot as dp
from kvcert.scales import scales_folder

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _measurement(kind: str, seconds: float, overhead: tuple[float, float, float], peak: float,
                 rss: float | None = None):
    study, cell = kind.split("/")
    load_model, load_data, warmup = overhead
    return dp.Measurement(kind=kind, study=study, cell=cell, model="m", items_run=3, seconds_per_item=seconds,
                          first_item_s=seconds + warmup, warmup_s=warmup, load_model_s=load_model,
                          load_data_s=load_data, write_s=0.0, peak_memory_gb=peak,
                          memory_measure="cuda_max_memory_allocated", peak_rss_gb=rss if rss is not None else peak,
                          device="cuda:0", device_name="Test GPU", device_memory_gb=80.0)


MEASURED = {"s/a": _measurement("s/a", 12.5, (30.0, 4.0, 6.0), 17.0, rss=20.0),
            "s/b": _measurement("s/b", 3.0, (20.0, 1.0, 0.0), 30.0, rss=10.0)}
CELLS = {"s/a": {"kind": "s/a", "shards": 8, "items": 1201}, "s/b": {"kind": "s/b", "shards": 4, "items": 600}}


def test_seconds_per_item_leaves_the_first_items_warmup_apart():
    per_item, warmup = dp.summarize([3.0, 1.0, 1.5], write_s=0.3)
    assert per_item == pytest.approx(1.25 + 0.1) and warmup == pytest.approx(3.0 - 1.25)
    # a first item faster than the rest is no warm-up; one item is its own item time
    assert dp.summarize([1.0, 2.0], 0.0) == (2.0, 0.0)
    assert dp.summarize([2.0], write_s=0.5) == (2.5, 0.0)
    with pytest.raises(dp.PilotError, match="no item ran"):
        dp.summarize([], 0.0)


def test_plan_is_items_times_measured_seconds_times_the_stated_safety_factor():
    needs = {n.cell: n for n in dp.plan_cells(MEASURED, CELLS, safety=1.5, memory_factor=1.2, reserve_gb=2.0,
                                             card_gb=80, devices_per_cell=1, host_mem_mb=32000)}
    a = needs["s/a"]
    assert a.items_per_shard == 151  # ceil(1201 / 8): shard 0 holds the most
    assert a.overhead_s == pytest.approx(40.0)
    assert a.shard_seconds == pytest.approx(40.0 + 151 * 12.5)
    assert a.runtime_min == math.ceil(1.5 * (40.0 + 151 * 12.5) / 60) == 49
    assert a.device_hours == pytest.approx(1.5 * (8 * 40.0 + 1201 * 12.5) / 3600)
    assert a.memory_gb == pytest.approx(17.0 * 1.2 + 2.0) and a.memory_class_gb == 24
    assert a.mem_mb == 32000  # the scale's host memory when the measured RSS x factor is below it
    b = needs["s/b"]
    assert b.memory_gb == pytest.approx(38.0) and b.memory_class_gb == 40
    assert b.runtime_min == math.ceil(1.5 * (21.0 + 150 * 3.0) / 60)
    assert dp.totals(list(needs.values()))["device_hours"] == pytest.approx(a.device_hours + b.device_hours)
    assert dp.totals(list(needs.values()))["cell_jobs"] == 12
    # two GPUs per cell double the device-hours, not the runtime; host memory follows a larger measured RSS
    two = {n.cell: n for n in dp.plan_cells(MEASURED, CELLS, card_gb=80, devices_per_cell=2, host_mem_mb=1000)}
    assert two["s/a"].device_hours == pytest.approx(2 * a.device_hours) and two["s/a"].runtime_min == a.runtime_min
    assert two["s/a"].mem_mb == math.ceil(20.0 * 1.2 * 1000)


def test_a_cell_that_does_not_fit_the_card_is_refused_by_name():
    with pytest.raises(dp.PilotError) as err:
        dp.plan_cells(MEASURED, CELLS, card_gb=24)
    message = str(err.value)
    assert "cell s/b needs 38.0 GB" in message and "the card has 24.0 GB" in message
    assert "30.00 GB x 1.2 + 2 GB reserve" in message
    with pytest.raises(dp.PilotError, match="cell s/a needs 22.4 GB.*1 more cells do not fit"):
        dp.plan_cells(MEASURED, CELLS, card_gb=16)
    dp.plan_cells(MEASURED, CELLS, card_gb=38.0)  # exactly enough fits


def test_one_constraint_for_every_cell_names_the_cards_that_hold_the_largest():
    features = dp.parse_features("24=l4,40=a100_40g, 80=a100_80g|h100")
    assert features == {24: "l4", 40: "a100_40g", 80: "a100_80g|h100"}
    needs = dp.plan_cells(MEASURED, CELLS, card_gb=80, features=features)
    assert {n.constraint for n in needs} == {"a100_40g|a100_80g|h100"}  # s/b needs 38 GB: not the 24 GB L4
    with pytest.raises(dp.PilotError, match="cell s/b needs 38.0 GB.*no card of --gpu-features"):
        dp.plan_cells(MEASURED, CELLS, card_gb=80, features={24: "l4", 32: "v100"})
    assert all(n.constraint is None for n in dp.plan_cells(MEASURED, CELLS, card_gb=80))
    for bad in ("80", "x=a100", "40=", "0=a"):
        with pytest.raises(dp.PilotError, match="--gpu-features"):
            dp.parse_features(bad)


def test_read_plan_refuses_another_scales_plan_and_a_missing_cell(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"scale": "paper", "cells": {"s/a": {"runtime": 9, "mem_mb": 5, "x": 1}}}))
    assert dp.read_plan(path, "paper", ["s/a"]) == {"s/a": {"runtime": 9, "mem_mb": 5}}
    with pytest.raises(dp.PilotError, match="a plan of scale=paper, not of scale=mysite"):
        dp.read_plan(path, "mysite", ["s/a"])
    with pytest.raises(dp.PilotError, match="has no cell s/b of scale=paper"):
        dp.read_plan(path, "paper", ["s/a", "s/b"])


# ---------------------------------------------------------------------------------------------------------------
# The command on measurements already in its scratch folder (--reuse): no model runs


def _tiny_scale(root: Path, models: dict[str, str], out: Path) -> None:
    scales = scales_folder(root)
    scales.mkdir(parents=True, exist_ok=True)
    text = f"""
outdir: {out}
figure_dir: {out}/figures
threads_per_cell: 1
gpus_per_cell: 0
models:
""" + "".join(f"  {key}: [model=hf, model.name={path}, model.dtype=bfloat16]\n" for key, path in models.items()) + f"""
grid: ["policies=[snapkv]", "designs=[topk,poisson]", "budgets=[0.25]", "seeds=[0]"]
studies:
  tiny:
    prereg: 5
    matrix:
      models: [{next(iter(models))}]
      data:
        ruler: [data=ruler, "data.tasks=[niah_single,niah_multikey]", data.context_tokens=300, n_items=30]
      settings: [question_aware, streaming]
      shards: 4
exploratory:
  extra:
    model: {next(iter(models))}
    shards: 2
    analysis: accuracy
    base: [data=ruler, "data.tasks=[niah_single]", data.context_tokens=300, n_items=10, "designs=[poisson]",
           "budgets=[0.5]", "seeds=[0]"]
    variants:
      knorm: [setting=streaming, "policies=[knorm]"]
resources:
  cell: {{mem_mb: 2000, runtime: 10}}
"""
    (scales / "tiny.yaml").write_text(text)


def _pilot(*args, cwd=ROOT, timeout=900):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([sys.executable, "-m", "kvcert.device_pilot", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_command_refuses_a_small_card_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """Measurements planted in the scratch folder as a pilot run leaves them (this test is about the command's own
    plan and refusal, so no model runs): a card too small ends on one line naming the cell, and no plan appears;
    a card that fits writes the three files, whose numbers follow the measurements. In this process: the command's
    main, as its console script calls it."""
    import kvcert.provenance

    # the code's fingerprint held fixed: a checkout edited while the test runs must not make it measure again
    monkeypatch.setattr(kvcert.provenance, "code_fingerprint", lambda: "fingerprint-of-the-planted-runs")
    root, out = tmp_path / "root", tmp_path / "out"
    _tiny_scale(root, {"llama": str(tmp_path / "no-such-model")}, out)
    scale, kinds = dp.scale_kinds("tiny", root)
    assert list(kinds) == ["tiny/llama-ruler-question_aware", "tiny/llama-ruler-streaming", "extra/knorm"]
    scratch = out / "pilot-scratch"
    for i, (key, kind) in enumerate(kinds.items()):
        overrides = dp.pilot_overrides(kind, scale, 2, (scratch / key / "cell").resolve(), out / "longbench")
        (scratch / key).mkdir(parents=True)
        (scratch / key / "measure.json").write_text(json.dumps({
            "item_seconds": [2.0 + i, 1.0 + i], "wall_seconds": {"load_model": 3.0, "load_data": 0.5, "write": 0.2},
            "device": "cuda:0", "dtype": "bfloat16", "device_name": "Test GPU", "device_memory_gb": 24.0,
            "peak_rss_gb": 5.0, "peak_memory_gb": 10.0 + 5 * i, "memory_measure": "cuda_max_memory_allocated",
            "code_fingerprint": "fingerprint-of-the-planted-runs", "overrides": overrides}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def pilot(*args):
        code = dp.main(["scale=tiny", "--root", str(root), "--reuse", *map(str, args)])
        return code, capsys.readouterr().err

    code, err = pilot("--cells", "tiny/*")  # a part of the scale: measured, never planned
    assert code == 0 and "plan the whole scale with kvcert-pilot scale=tiny --reuse" in err, err[-2000:]
    assert "kvcert-pilot: extra/knorm" not in err and not (out / "pilot").exists()
    code, err = pilot()
    assert code == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    # extra/knorm: 20 GB x 1.2 + 2 = 26 GB on the device's own 24 GB
    assert last.startswith("kvcert-pilot: error: cell extra/knorm needs 26.0 GB") and "the card has 24.0 GB" in last
    assert not (out / "pilot").exists()
    code, err = pilot("--gpu-memory-gb", 40, "--safety", 2)
    assert code == 0, err[-2000:]
    table = pd.read_csv(out / "pilot" / "pilot.csv")
    assert list(table["kind"]) == list(kinds)
    assert list(table["seconds_per_item"]) == pytest.approx([1.0 + 0.1, 2.0 + 0.1, 3.0 + 0.1])
    assert list(table["warmup_s"]) == pytest.approx([1.0, 1.0, 1.0])
    plan = json.loads((out / "pilot" / "plan.json").read_text())
    assert plan["card_gb"] == 40 and plan["safety"] == 2
    a = plan["cells"]["tiny/llama-ruler-question_aware"]
    assert a["items_per_shard"] == 8 and a["overhead_s"] == pytest.approx(3.0 + 0.5 + 1.0)
    assert a["runtime"] == math.ceil(2 * (4.5 + 8 * 1.1) / 60)
    assert a["device_hours"] == pytest.approx(2 * (4 * 4.5 + 30 * 1.1) / 3600, abs=1e-6)
    assert plan["total"]["device_hours"] == pytest.approx(sum(c["device_hours"] for c in plan["cells"].values()),
                                                          abs=1e-5)
    assert "Measured by `kvcert-pilot` on Test GPU" in (out / "pilot" / "plan.md").read_text()
    # kvcert-plan prints the measurement beside its model for this scale, and for no other
    from kvcert.plan import measured_plan, render_measured

    beside = render_measured({"measured": measured_plan(out / "pilot" / "plan.json", "tiny")})
    assert f"{plan['total']['device_hours']:.1f} device-hours with safety factor 2" in beside
    assert "most device memory 26.0 GB (extra/knorm)" in beside
    assert measured_plan(out / "pilot" / "plan.json", "paper") is None
    # a later refusal leaves the earlier plan as it was
    before = {p.name: p.read_bytes() for p in (out / "pilot").iterdir()}
    code, err = pilot("--gpu-memory-gb", 12)
    assert code == 1 and "cell tiny/llama-ruler-question_aware needs 14.0 GB" in err
    assert {p.name: p.read_bytes() for p in (out / "pilot").iterdir()} == before


# ---------------------------------------------------------------------------------------------------------------
# The workflow reads the plan


def _dry_run(out: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCERT_SLURM_", "SBATCH_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(BIN / "snakemake"), "-n", "--workflow-profile", str(ROOT / "workflow/profiles/slurm"),
                           "--config", "scale=paper", f"outdir={out}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # make test-full: a Snakemake dry run of a scale with a measured plan
def test_rule_cell_takes_runtime_memory_and_constraint_from_the_plan(tmp_path):
    from kvcert.scales import load_scale, study_cells

    cells = [f"{study}/{cell}" for study, cell in study_cells(load_scale("paper", scales_folder(ROOT)))]
    plan = {"scale": "paper", "cells": {c: {"runtime": 30 + i, "mem_mb": 40000 + i, "constraint": "a100_80g|h100"}
                                        for i, c in enumerate(cells)}}
    (tmp_path / "pilot").mkdir()
    (tmp_path / "pilot" / "plan.json").write_text(json.dumps(plan))
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = {}
    rule = wildcards = None
    for line in (proc.stdout + proc.stderr).splitlines():
        line = line.strip()
        if line.startswith("rule "):
            rule = line
        elif rule == "rule cell:" and line.startswith("wildcards:"):
            wildcards = dict(part.split("=", 1) for part in line.split(":", 1)[1].strip().split(", "))
        elif rule == "rule cell:" and line.startswith("resources:") and wildcards:
            seen[(f"{wildcards['study']}/{wildcards['cell']}", wildcards["shard"])] = line
            rule = wildcards = None
    assert len(seen) == 232  # study paper: 27 cells (9 defended) x 8 shards; the leaderboard: 4 x 4
    for (cell, _), line in seen.items():
        i = cells.index(cell)
        assert f"runtime={30 + i}," in line and f"mem_mb={40000 + i}," in line and "constraint=a100_80g|h100" in line


# ---------------------------------------------------------------------------------------------------------------
# The pilot itself, on this CPU, over random-weight stand-ins


@pytest.mark.cluster
@pytest.mark.smollm2  # the stand-ins carry the bundled SmolLM2's tokenizer
def test_pilot_measures_every_cell_kind_of_a_scale_on_stand_ins(tmp_path):
    build = subprocess.run([sys.executable, "-m", "kvcert.standins", "--out", str(tmp_path / "standins"), "--models",
                            "llama", "--layers", "2", "--head-dim", "8", "--stop-fraction", "0.2",
                            "--longbench-tokens", "0"], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    root, out = tmp_path / "root", tmp_path / "out"
    _tiny_scale(root, {"llama": str(tmp_path / "standins" / "models" / "llama")}, out)
    proc = _pilot("scale=tiny", "--root", root, "--items", 2, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvcert-pilot: tiny/llama-ruler-streaming:" in proc.stderr  # progress per cell kind
    table = pd.read_csv(out / "pilot" / "pilot.csv")
    assert list(table["kind"]) == ["tiny/llama-ruler-question_aware", "tiny/llama-ruler-streaming", "extra/knorm"]
    assert (table["items_run"] == 2).all() and (table["seconds_per_item"] > 0).all()
    assert (table["load_model_s"] > 0).all() and (table["peak_memory_gb"] > 0.05).all()
    assert (table["memory_measure"] == "peak_rss").all() and (table["device"] == "cpu").all()
    assert (table["device_memory_gb"] > 0).all()
    # each kind ran as its cell runs, with the pilot's item count, into the scratch folder
    for kind in table["kind"]:
        cell = out / "pilot-scratch" / kind / "cell"
        items = pd.read_parquet(cell / "items.parquet")
        assert items["item_id"].nunique() == 2
        manifest = json.loads((cell / "manifest.json").read_text())
        assert manifest["n_shard_items"] == 2
    plan = json.loads((out / "pilot" / "plan.json").read_text())
    safety = plan["safety"]
    for row in table.itertuples():
        cell = plan["cells"][row.kind]
        overhead = row.load_model_s + row.load_data_s + row.warmup_s
        assert cell["device_hours"] == pytest.approx(
            safety * (cell["shards"] * overhead + cell["items"] * row.seconds_per_item) / 3600, rel=1e-4, abs=1e-6)
        assert cell["runtime"] == max(1, math.ceil(
            safety * (overhead + cell["items_per_shard"] * row.seconds_per_item) / 60))
    assert plan["total"]["device_hours"] == pytest.approx(sum(c["device_hours"] for c in plan["cells"].values()),
                                                          abs=1e-5)
    # the measured memory refuses a card too small for it, naming the cell, and writes nothing new
    before = {p.name: p.read_bytes() for p in (out / "pilot").iterdir()}
    refused = _pilot("scale=tiny", "--root", root, "--reuse", "--gpu-memory-gb", 1, cwd=root, timeout=300)
    assert refused.returncode == 1
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("kvcert-pilot: error: cell tiny/llama-ruler-question_aware needs ")
    assert "the card has 1.0 GB" in last
    assert {p.name: p.read_bytes() for p in (out / "pilot").iterdir()} == before


def test_a_longbench_cell_without_its_local_copy_is_refused_before_running(tmp_path):
    from kvcert.scales import load_scale

    scale, kinds = dp.scale_kinds("paper", ROOT)
    kind = kinds["paper/qwen7b-longbench6k-question_aware"]
    with pytest.raises(dp.PilotError, match=r"reads LongBench from the hub: no local copy at .*snakemake --cores 1 "
                                            r"--config scale=paper results/paper/data/longbench"):
        dp.pilot_overrides(kind, scale, 2, tmp_path / "cell", tmp_path / "missing")
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "narrativeqa.jsonl").write_text("{}\n")
    overrides = dp.pilot_overrides(kind, scale, 3, tmp_path / "cell", tmp_path / "copy")
    assert overrides[-6:] == [f"data.path={tmp_path / 'copy'}", "n_items=3", "shard=0", "n_shards=1", "threads=4",
                              f"out_dir={tmp_path / 'cell'}"]
    model = load_scale("paper", scales_folder(ROOT))["models"]["qwen7b"]
    assert overrides[:-6] == kind["overrides"] and kind["overrides"][:len(model)] == model  # the cell's own

"""The cost model behind kvcert-plan, against what real models and caches hold, and the plan command."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvcert import costs
from kvcert.architectures import PUBLISHED, published

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def _tiny(name: str, **sizes):
    from kvcert.standins import shrunk_config

    fields = shrunk_config(name, vocab_size=512, **sizes)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_count_is_exact(name):
    model = _tiny(name, layers=2, kv_heads=2, head_dim=8)
    arch = costs.Architecture.from_config(model.config)
    assert arch.parameters == sum(p.numel() for p in model.parameters())
    assert costs.weight_bytes(arch, "float32") == sum(p.numel() * p.element_size() for p in model.parameters())


def test_published_architectures_have_their_known_sizes():
    sizes = {name: costs.Architecture.from_config(AutoConfig.for_model(f.pop("model_type"), **f)).parameters
             for name, f in ((n, published(n)) for n in PUBLISHED)}
    assert round(sizes["Qwen/Qwen2.5-7B-Instruct"] / 1e9, 2) == 7.62
    assert round(sizes["meta-llama/Llama-3.1-8B-Instruct"] / 1e9, 2) == 8.03
    assert round(sizes["mistralai/Mistral-7B-Instruct-v0.3"] / 1e9, 2) == 7.25


def _layer_bytes(layer) -> int:
    return sum(buf.numel() * buf.element_size() for buf in layer._buffers)


def test_cache_bytes_match_the_cache_kvcert_builds():
    """The prefill's cache and a derived batch hold exactly the slots the model counts."""
    from kvcert import prefill, select

    model = _tiny("meta-llama/Llama-3.1-8B-Instruct", layers=2, kv_heads=2, head_dim=8)
    arch = costs.Architecture.from_config(model.config)
    n = 300
    state = prefill(model, torch.randint(5, 500, (1, n)), setting="question_aware")
    held = sum(_layer_bytes(layer) for layer in state.cache.layers)
    assert held == costs.full_cache_bytes(arch, n, "float32")
    rows = [select(state, "snapkv", "topk", 0.25), select(state, "snapkv", "topk", 0.25), None]
    reserve = 16
    batch = state.cache.derive_batch(rows[:2], reserve=reserve)
    got = sum(_layer_bytes(layer) for layer in batch.layers)
    plan = costs.CellPlan(batches=(costs.Batch(rows=2, budget=0.25),), certify=False, oracle=False)
    predicted = costs.batch_bytes(arch, costs.Prompt(n=n, suffix=0, new_tokens=reserve), plan.batches[0],
                                  "float32", plan)["batch_cache"]
    assert got == predicted
    full = state.cache.derive_batch([None], reserve=reserve)
    assert sum(_layer_bytes(layer) for layer in full.layers) == (n + reserve) * costs.slot_bytes(arch, "float32")


def test_costs_grow_as_they_should():
    fields = published("meta-llama/Llama-3.1-8B-Instruct")
    arch = costs.Architecture.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    plan = costs.CellPlan(batches=(costs.Batch(1, 1.0), costs.Batch(9, 0.25, 7), costs.Batch(6, 0.5, 4)),
                          accumulate=True)
    short, long = (costs.Prompt(n=n, suffix=64, new_tokens=32) for n in (6000, 16000))
    a, b = costs.peak_bytes(arch, short, "bfloat16", plan), costs.peak_bytes(arch, long, "bfloat16", plan)
    assert a["weights"] == b["weights"] == costs.weight_bytes(arch, "bfloat16")
    assert b["full_cache"] / a["full_cache"] == pytest.approx(16000 / 6000)
    assert b["total"] > a["total"] and a["total"] == sum(v for k, v in a.items() if k != "total")
    serving = costs.CellPlan(batches=plan.batches, oracle=False, accumulate=True)
    assert costs.peak_bytes(arch, long, "bfloat16", serving)["total"] < b["total"]  # the oracle costs memory
    # attention makes the prefill superlinear in n
    f6, f16 = (costs.prefill_flops(arch, n, plan) for n in (6000, 16000))
    assert f16 / f6 > 16000 / 6000
    h100 = costs.Device("H100", 80, 989e12, 3.35e12, 0.4, 0.6, 1e-3)
    t = costs.item_seconds(arch, long, "bfloat16", plan, h100)
    assert t["passes"] == 3 * 32  # per batch: the question pass, then 31 generated tokens
    assert t["total"] == pytest.approx(t["prefill"] + t["decode"])


def test_plan_prints_jobs_memory_and_gpu_hours_for_the_paper_scale(scale_dag, monkeypatch, capsys):
    from kvcert import plan as plan_module

    # kvcert-plan in this process, its jobs from the session's dry run of the paper scale (tests/conftest.py; the
    # same kvcert.plan.plan_jobs, built once for every test that reads that DAG).
    monkeypatch.setattr(plan_module, "plan_jobs", lambda name, root: scale_dag(name))
    # the text and the --json output below print one plan: kvcert.plan.plan_scale computed once for both
    monkeypatch.setattr(plan_module, "plan_scale", functools.cache(plan_module.plan_scale))
    assert plan_module.main(["scale=paper", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "jobs per rule: cell 232" in out  # study paper's 27 cells (9 defended) x 8 shards, the leaderboard's 4 x 4
    for cell in ("paper/qwen7b-longbench16k-streaming", "paper/llama8b-ruler-question_aware",
                 "paper/mistral7b-longbench6k-streaming", "leaderboard/query_agnostic", "leaderboard/query_aware_adakv"):
        assert cell in out
    assert "model qwen3_8b: 8.19B parameters, 36 layers, 32 query / 8 KV heads of 128" in out
    assert "H200-141GB" in out and "GPU-hours" in out and "about 70 GPU-hours" in out
    assert plan_module.main(["scale=paper", "--root", str(ROOT), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["cells"]) == 31 and plan["jobs"]["cell"] == 232
    assert all(c["fits_gb"]["141"] for c in plan["cells"])
    assert 0 < plan["gpu_hours"]["H200-141GB"] < plan["gpu_hours"]["A100-40GB"]


def test_plan_of_an_unknown_scale_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "kvcert.plan", "scale=huge", "--root", str(ROOT)], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("kvcert-plan: error: scale=huge: unknown scale; known:")

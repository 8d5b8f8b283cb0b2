"""What a cell's tables and files promise, on a tiny Qwen2 GGUF (SmolLM2's tokenizer) and RULER items of ~200 tokens.

One cell, run through ``kvcert.runner.cli.main`` (the function behind the ``kvcert-run`` console script) in
this process to stay fast: two policies × both designs × two budgets × three seeds, plus extra grids that
partly repeat the main grid. Checked: the manifest (packages, model sha256, dataset hash, wall seconds per
stage), config.yaml (equal to the composed config, and re-running it reproduces the tables), extra grids add
only new configurations, deterministic designs run once per item (seed 0) while Poisson runs once per seed,
and the retained tokens and bytes follow the budget.
"""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from helpers.cells import check_cell, expected_configurations
from helpers.tiny_gguf import shared_kvcert_cache, shared_tiny_gguf

POLICIES = ["snapkv", "uniform"]
DESIGNS = ["topk", "poisson"]
BUDGETS = [0.25, 0.5]
SEEDS = [0, 1, 2]
# The first grid repeats uniform/topk/0.25 and snapkv/poisson/0.5/seed 1 of the main grid and adds the rest;
# the second is entirely a repeat.
EXTRA = ("[{policies:[snapkv,h2o],designs:[poisson],budgets:[0.5,0.75],seeds:[1,7]},"
         "{policies:[uniform],designs:[topk],budgets:[0.25]}]")
CONTEXT_TOKENS = 200
N_ITEMS = 2


def _overrides(tiny, out_dir) -> list[str]:
    return [
        "data=ruler", f"data.context_tokens={CONTEXT_TOKENS}", "model=gguf", f"model.path={tiny.path}",
        f"policies=[{','.join(POLICIES)}]", f"designs=[{','.join(DESIGNS)}]",
        f"budgets=[{','.join(map(str, BUDGETS))}]", f"seeds=[{','.join(map(str, SEEDS))}]",
        f"extra_grids={EXTRA}", f"n_items={N_ITEMS}", "threads=1", "progress=false", f"out_dir={out_dir}",
    ]


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    """(tiny model, out_dir, overrides) of one finished cell."""
    from kvcert.runner import cli

    tiny = shared_tiny_gguf(tmp_path_factory, "qwen2")
    patch = pytest.MonkeyPatch()
    patch.setenv("KVCERT_CACHE", str(shared_kvcert_cache(tmp_path_factory)))
    threads = torch.get_num_threads()
    out_dir = tmp_path_factory.mktemp("tables") / "cell"
    overrides = _overrides(tiny, out_dir)
    try:
        assert cli.main(overrides) == 0
        yield tiny, out_dir, overrides
    finally:
        torch.set_num_threads(threads)
        patch.undo()


@pytest.fixture(scope="module")
def tables(cell):
    tiny, out_dir, _ = cell
    return pd.read_parquet(out_dir / "items.parquet"), pd.read_parquet(out_dir / "steps.parquet")


def _all_configurations() -> set[tuple]:
    out = expected_configurations(POLICIES, DESIGNS, BUDGETS, SEEDS)
    out |= expected_configurations(["snapkv", "h2o"], ["poisson"], [0.5, 0.75], [1, 7])
    out |= expected_configurations(["uniform"], ["topk"], [0.25], SEEDS)
    return out


def test_cell_tables_follow_the_contract(cell, tables):
    tiny, out_dir, _ = cell
    items, _ = tables
    check_cell(out_dir, item_ids=sorted(items["item_id"].unique()), configurations=_all_configurations(),
               setting="question_aware", num_layers=tiny.num_layers, num_kv_heads=tiny.num_kv_heads)
    assert items["item_id"].nunique() == N_ITEMS
    assert (items["data"] == "ruler").all()


def test_extra_grids_add_configurations_without_duplicates(tables):
    items, _ = tables
    main = expected_configurations(POLICIES, DESIGNS, BUDGETS, SEEDS)
    configs = _all_configurations()
    new = configs - main
    # snapkv/poisson/0.5 seed 1 and uniform/topk/0.25 repeat the main grid; these are new:
    assert new == {("snapkv", "poisson", 0.5, 7), ("snapkv", "poisson", 0.75, 1), ("snapkv", "poisson", 0.75, 7),
                   ("h2o", "poisson", 0.5, 1), ("h2o", "poisson", 0.5, 7), ("h2o", "poisson", 0.75, 1),
                   ("h2o", "poisson", 0.75, 7)}
    per_item = items.groupby("item_id").size()
    assert (per_item == len(configs)).all(), per_item
    keys = ["item_id", "policy", "design", "budget", "seed"]
    assert not items.duplicated(keys).any()


def test_deterministic_designs_run_once_and_poisson_once_per_seed(tables):
    items, _ = tables
    topk = items[items["design"] == "topk"]
    assert (topk["seed"] == 0).all()
    assert (topk.groupby(["item_id", "policy", "budget"]).size() == 1).all()
    poisson = items[(items["design"] == "poisson") & items["policy"].isin(POLICIES) & items["budget"].isin(BUDGETS)]
    seeds = poisson.groupby(["item_id", "policy", "budget"])["seed"].apply(lambda s: sorted(s.tolist()))
    for key, got in seeds.items():
        expected = sorted(set(SEEDS) | ({1, 7} if key[1] == "snapkv" and key[2] == 0.5 else set()))
        assert got == expected, (key, got)
    # Different seeds are different draws: the retained counts or the certificates differ.
    varied = poisson.groupby(["item_id", "policy", "budget"]).agg(
        retained=("retained_tokens", "nunique"), cert=("cert_mean", "nunique"))
    assert ((varied["retained"] > 1) | (varied["cert"] > 1)).all()


def test_retained_tokens_and_bytes_follow_the_budget(cell, tables):
    tiny, _, _ = cell
    items, _ = tables
    rows = tiny.num_layers * tiny.num_kv_heads  # retained_tokens is a mean over layers × KV heads
    compressed = items[items["policy"] != "full"]
    assert len(compressed) > 0
    for r in compressed.itertuples():
        target = max(min(36, r.context_tokens), round(r.budget * r.context_tokens))  # sinks + recent floor
        if r.design == "topk":
            assert r.retained_tokens == pytest.approx(target), r
        else:
            # Σπ = target per row; Poisson spread of the mean over rows is at most sqrt(target / rows).
            spread = math.sqrt(target / rows)
            assert abs(r.retained_tokens - target) <= 5 * spread + 1, (r.policy, r.budget, r.retained_tokens, target)
        ratio = r.cache_bytes / r.full_bytes
        assert ratio <= r.budget + 0.05, (r.policy, r.design, r.budget, ratio)
    # On average over seeds and items, Poisson retains the budget.
    poisson = compressed[compressed["design"] == "poisson"]
    mean_fraction = (poisson["retained_tokens"] / poisson["context_tokens"]).groupby(poisson["budget"]).mean()
    for budget, fraction in mean_fraction.items():
        assert fraction == pytest.approx(budget, abs=0.05)
    assert items["context_tokens"].between(0.8 * CONTEXT_TOKENS, 1.3 * CONTEXT_TOKENS).all()


def test_manifest_records_provenance(cell):
    tiny, out_dir, _ = cell
    from kvcert.models import sha256_file
    from kvcert.provenance import numeric_platform

    manifest = json.loads((out_dir / "manifest.json").read_text())
    packages = manifest["packages"]
    for name in ("torch", "transformers", "numpy", "pandas", "gguf"):
        assert packages.get(name), f"manifest lacks the version of {name}"
    assert packages["torch"] == torch.__version__.split("+")[0] or packages["torch"] in torch.__version__
    assert manifest["model"]["kind"] == "gguf"
    assert manifest["model"]["sha256"] == sha256_file(tiny.path)
    assert re.fullmatch(r"[0-9a-f]{64}", manifest["dataset_sha256"])
    wall = manifest["wall_seconds"]
    for stage in ("load_model", "load_data", "prefill", "decode", "write", "total"):
        assert stage in wall and wall[stage] >= 0, stage
    assert wall["total"] >= max(v for k, v in wall.items() if k != "total")
    assert manifest["n_shard_items"] == N_ITEMS
    # what make verify-results compares before it demands equal bytes
    assert manifest["numeric_platform"] == numeric_platform()


def test_dataset_hash_is_the_hash_of_the_items(cell, tmp_path_factory):
    tiny, out_dir, _ = cell
    from kvcert.data import load_items
    from kvcert.models import load_tokenizer
    from kvcert.runner.cell import dataset_hash

    patch = pytest.MonkeyPatch()
    patch.setenv("KVCERT_CACHE", str(shared_kvcert_cache(tmp_path_factory)))
    try:
        tokenizer = load_tokenizer({"kind": "gguf", "path": str(tiny.path)})
    finally:
        patch.undo()
    config = OmegaConf.to_container(OmegaConf.load(out_dir / "config.yaml").data, resolve=True)
    items = load_items("ruler", config, tokenizer, N_ITEMS)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["dataset_sha256"] == dataset_hash(items)


def test_config_yaml_round_trips(cell, tables, tmp_path, tmp_path_factory):
    """config.yaml is the composed config (less the keys added since, at their default); running it again
    reproduces the item table."""
    from kvcert.run_schema import elide_defaults
    from kvcert.runner.cell import run_cell
    from kvcert.hydra_app import compose

    tiny, out_dir, overrides = cell
    saved = OmegaConf.load(out_dir / "config.yaml")
    composed = compose(overrides)
    assert OmegaConf.to_container(saved, resolve=True) == elide_defaults(OmegaConf.to_container(composed, resolve=True))

    patch = pytest.MonkeyPatch()
    patch.setenv("KVCERT_CACHE", str(shared_kvcert_cache(tmp_path_factory)))
    threads = torch.get_num_threads()
    try:
        run_cell(saved, tmp_path / "again")
    finally:
        torch.set_num_threads(threads)
        patch.undo()
    items, _ = tables
    again = pd.read_parquet(tmp_path / "again" / "items.parquet")
    keys = ["item_id", "policy", "design", "budget", "seed"]
    left, right = items.sort_values(keys).reset_index(drop=True), again.sort_values(keys).reset_index(drop=True)
    pd.testing.assert_frame_equal(left, right, check_exact=False, rtol=1e-5, atol=1e-6)
    again_manifest = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert again_manifest["dataset_sha256"] == json.loads((out_dir / "manifest.json").read_text())["dataset_sha256"]


def test_an_allocator_is_recorded_only_when_it_is_not_uniform(cell, tables, tmp_path_factory):
    """A uniform cell's files carry no allocator key or column (as before allocators existed); an AdaKV cell's
    items name it, and their kept bytes are the budget's: per layer kv_heads · round(budget · n) slots. Its items
    and steps name the allocator and, set away from its default, the certain-head share (amendment 5's factors),
    which a default cell's tables lack."""
    from kvcert.runner import cli
    from kvcert.table_columns import ALLOCATOR_ITEM_COLUMNS, SHARE_COLUMNS

    tiny, out_dir, overrides = cell
    items, steps = tables
    assert not set(ALLOCATOR_ITEM_COLUMNS + SHARE_COLUMNS) & set(items.columns)
    assert not set(ALLOCATOR_ITEM_COLUMNS + SHARE_COLUMNS) & set(steps.columns)
    assert "allocator" not in OmegaConf.load(out_dir / "config.yaml")
    ada_dir = tmp_path_factory.mktemp("adakv") / "cell"
    keep = [o for o in overrides if o.split("=")[0] in ("data", "data.context_tokens", "model", "model.path",
                                                         "threads", "progress")]
    patch = pytest.MonkeyPatch()
    patch.setenv("KVCERT_CACHE", str(shared_kvcert_cache(tmp_path_factory)))
    threads = torch.get_num_threads()
    try:
        assert cli.main([*keep, "policies=[snapkv]", "designs=[topk,poisson]", "budgets=[0.5]", "seeds=[0]",
                         "n_items=1", "allocator=adakv", "+allocator_options={alpha_safeguard: 0.5}",
                         "design_options.head_fraction=0.8", f"out_dir={ada_dir}"]) == 0
    finally:
        torch.set_num_threads(threads)
        patch.undo()
    ada = pd.read_parquet(ada_dir / "items.parquet")
    assert list(ada.columns[-3:]) == ALLOCATOR_ITEM_COLUMNS + SHARE_COLUMNS
    assert set(ada["head_fraction"]) == {0.8}
    ada_steps = pd.read_parquet(ada_dir / "steps.parquet")
    assert len(ada_steps) and set(ada_steps["allocator"]) == {"adakv"} and set(ada_steps["head_fraction"]) == {0.8}
    compressed = ada[ada["policy"] != "full"]
    assert set(compressed["allocator"]) == {"adakv"}
    assert (compressed["kept_bytes"] <= compressed["cache_bytes"]).all()
    topk = compressed[compressed["design"] == "topk"].iloc[0]
    full = ada[ada["policy"] == "full"].iloc[0]
    # kept / full bytes = kept slots / prefix slots, and top-k keeps round(budget · n) per head on average
    n = int(topk["context_tokens"])
    assert topk["kept_bytes"] * n == full["full_bytes"] * max(36, round(0.5 * n))
    saved = OmegaConf.load(ada_dir / "config.yaml")
    assert saved.allocator == "adakv" and saved.allocator_options == {"alpha_safeguard": 0.5}

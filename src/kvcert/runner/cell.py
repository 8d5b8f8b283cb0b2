"""One experimental cell: every configuration of every item of a shard, on one shared prefill per item.

Each finished item is checkpointed under ``out_dir/.parts`` (steps first, items last, each written to a
temporary name and renamed), so a killed cell resumes at the first unfinished item with no duplicate
rows. The final tables, the resolved config and the manifest are written once every item is done.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..data import Item, is_correct, load_items, score_item
from ..generation import FULL, Prefill, decode_batch, eos_ids, prefill, select
from ..models import ModelSpec, load_model
from ..policies import get_policy
from .config import CellConfig, ConfigError, Configuration, validate
from .manifest import build_manifest
from .tables import (
    ITEM_COLUMNS,
    empty_step_table,
    logprob_summary,
    summarize_steps,
    tag_steps,
    unwritable_reason,
    write_parquet_atomic,
    write_text_atomic,
)

PARTS = ".parts"
# Keys that change what a cell computes; the rest (out_dir, progress, threads) do not.
_IDENTITY_KEYS = (
    "data", "model", "policies", "designs", "budgets", "seeds", "extra_grids", "setting", "n_items", "shard", "n_shards",
    "oracle", "certify", "delta", "window", "design_options", "max_context_tokens", "truncate",
)


def derive_seed(seed: int, item_id: str) -> int:
    """A per-item Poisson seed, so that items do not share one stream of draws."""
    return zlib.crc32(f"{seed}:{item_id}".encode()) & 0x7FFFFFFF


def _check_item(item: Item) -> None:
    if not item.context or not item.context.strip():
        raise ConfigError(f"item {item.id!r}: empty context")
    if not item.answers:
        raise ConfigError(f"item {item.id!r}: no reference answers")


def tokenize_item(tokenizer, item: Item, setting: str, limit: int, truncate: str, max_new_tokens: int):
    """(prefix_ids, suffix_ids), each (1, ·), after fitting the prompt into ``limit`` tokens.

    The context is tokenized with the tokenizer's special tokens and the question + answer prefix
    without, so both settings see identical token ids. Truncation cuts the middle of the context.
    """
    _check_item(item)
    context = tokenizer(item.context, add_special_tokens=True).input_ids
    question = tokenizer(item.question + item.answer_prefix, add_special_tokens=False).input_ids
    total = len(context) + len(question) + max_new_tokens
    if total > limit:
        if truncate == "error":
            raise ConfigError(
                f"item {item.id!r}: prompt + answer need {total} tokens > max_context_tokens={limit}; "
                "set truncate=middle or raise max_context_tokens"
            )
        keep = limit - len(question) - max_new_tokens
        if keep < 16:
            raise ConfigError(f"item {item.id!r}: the question alone does not fit in max_context_tokens={limit}")
        context = context[: keep // 2] + context[len(context) - (keep - keep // 2) :]
    ids = torch.tensor([context + question]) if setting == "question_aware" else torch.tensor([context])
    suffix = torch.tensor([[]], dtype=torch.long) if setting == "question_aware" else torch.tensor([question])
    return ids, suffix


def _identity(cfg: Mapping[str, Any], items: list[Item]) -> dict:
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
    config = {k: plain.get(k) for k in _IDENTITY_KEYS}
    return {"config": config, "items_sha256": dataset_hash(items)}


def dataset_hash(items: list[Item]) -> str:
    digest = hashlib.sha256()
    for item in items:
        record = [item.id, item.context, item.question, item.answer_prefix, list(item.answers), item.metric]
        digest.update(json.dumps(record, ensure_ascii=False).encode())
    return digest.hexdigest()


def batches(configurations: list[Configuration]) -> list[list[Configuration]]:
    """Configurations decoded together: the full cache alone (so its rows never depend on what else a cell
    runs), then one batch per budget (rows of one budget have similar slot counts, so little padding)."""
    groups: dict[float, list[Configuration]] = {}
    for conf in configurations:
        if not conf.is_full:
            groups.setdefault(conf.budget, []).append(conf)
    return [[c for c in configurations if c.is_full], *groups.values()]


def run_item(model, tokenizer, item: Item, prompt, cell: CellConfig, meta: dict, timings: dict):
    """All configurations of one item from one prefill: (item rows, step frame).

    prompt: the item's (prefix_ids, suffix_ids) from ``tokenize_item``.
    """
    max_new = int(item.max_new_tokens)
    prefix_ids, suffix_ids = prompt
    accumulate = any(get_policy(p).needs_accumulated_attention for p in cell.all_policies)
    start = time.perf_counter()
    state: Prefill = prefill(model, prefix_ids, suffix_ids, setting=cell.setting, window=cell.window, accumulate=accumulate)
    timings["prefill"] += time.perf_counter() - start
    stop = eos_ids(model, tokenizer)
    rows, steps = [], []
    for group in batches(cell.configurations()):
        start = time.perf_counter()
        selections = [
            None if conf.is_full else select(
                state, conf.policy, conf.design, conf.budget, derive_seed(conf.seed, item.id), cell.options)
            for conf in group
        ]
        decoded_group = decode_batch(
            model, state, selections, max_new_tokens=max_new, stop_ids=stop, certify=cell.certify,
            oracle=cell.oracle, delta=cell.delta, randomized=[conf.design == "poisson" for conf in group],
        )
        timings["decode"] += time.perf_counter() - start
        for conf, decoded in zip(group, decoded_group):
            prediction = tokenizer.decode(decoded.token_ids, skip_special_tokens=True)
            score = float(score_item(item, prediction))
            keys = {"item_id": item.id, "policy": conf.policy, "design": conf.design, "budget": conf.budget,
                    "seed": conf.seed, "setting": cell.setting}
            rows.append({
                **keys, "task": item.task, "prediction": prediction, "score": score,
                "correct": bool(is_correct(score, item.metric)), **logprob_summary(decoded.logprobs),
                **summarize_steps(decoded.steps), "retained_tokens": decoded.retained_tokens,
                "context_tokens": state.context_tokens, "new_tokens": len(decoded.token_ids),
                "cache_bytes": decoded.cache_bytes, "full_bytes": decoded.full_bytes, "metric": item.metric, **meta,
            })
            if len(decoded.steps):
                steps.append(tag_steps(decoded.steps, keys))
    step_frame = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()
    return pd.DataFrame(rows)[ITEM_COLUMNS], step_frame


def _model_limit(model, cell: CellConfig) -> int:
    config = model.config.get_text_config(decoder=True)
    native = getattr(config, "max_position_embeddings", None) or 1 << 30
    return min(cell.max_context_tokens or native, native)


def run_cell(cfg, out_dir: str | Path) -> Path:
    """Run one cell described by a resolved run config; returns ``out_dir``."""
    from omegaconf import OmegaConf

    wall = time.perf_counter()
    cell = validate(cfg)
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    timings: dict[str, float] = defaultdict(float)
    start = time.perf_counter()
    spec = ModelSpec.parse(OmegaConf.to_container(cfg.model, resolve=True))
    model, tokenizer = load_model(spec)
    timings["load_model"] = time.perf_counter() - start
    start = time.perf_counter()
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    items = load_items(data_cfg.get("name"), data_cfg, tokenizer, cell.n_items)
    shard_items = items[cell.shard :: cell.n_shards]
    timings["load_data"] = time.perf_counter() - start
    if not shard_items:
        raise ConfigError(f"shard={cell.shard} of n_shards={cell.n_shards} has no items (n_items={len(items)})")
    limit = _model_limit(model, cell)
    # Every item's prompt is tokenized (and so checked) before anything is written.
    prompts = [tokenize_item(tokenizer, item, cell.setting, limit, cell.truncate, int(item.max_new_tokens))
               for item in shard_items]

    parts = out_dir / PARTS
    identity = _identity(cfg, items)
    marker = parts / "identity.json"
    if marker.exists() and json.loads(marker.read_text()) != json.loads(json.dumps(identity)):
        raise ConfigError(
            f"out_dir={out_dir} holds a partial run of a different configuration or dataset; "
            "use another out_dir or delete it"
        )
    created = _created_dirs(parts)
    try:
        parts.mkdir(parents=True, exist_ok=True)
        write_text_atomic(json.dumps(identity, indent=1, sort_keys=True), marker)
    except OSError as err:
        _remove_empty(created)
        raise ConfigError(f"out_dir={out_dir}: cannot write there ({err.strerror or err})") from None
    try:
        return _run_items(cfg, cell, spec, model, tokenizer, items, shard_items, prompts, parts, out_dir, identity,
                          timings, wall)
    except BaseException:
        # A failure before any item finished leaves nothing behind; finished items are kept for the rerun.
        if not any(parts.glob("*.items.parquet")):
            marker.unlink(missing_ok=True)
            for leftover in [*parts.glob(".*.tmp"), *parts.glob("*.steps.parquet")]:
                leftover.unlink(missing_ok=True)
            _remove_empty(created)
        raise


def check_out_dir(out_dir: Path) -> None:
    """Fail early (before loading anything) if ``out_dir`` cannot be a directory we write into."""
    reason = unwritable_reason(out_dir)
    if reason:
        raise ConfigError(f"out_dir={out_dir}: {reason}")


def _created_dirs(path: Path) -> list[Path]:
    """The directories that ``path.mkdir(parents=True)`` would create, deepest first."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    for d in dirs:  # deepest first
        try:
            d.rmdir()
        except OSError:
            break


def _run_items(cfg, cell, spec, model, tokenizer, items, shard_items, prompts, parts, out_dir, identity, timings, wall):
    from omegaconf import OmegaConf

    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    meta = {"model": spec.kind if spec.kind != "hf" else str(spec.name), "data": data_cfg.get("name")}
    if spec.kind == "gguf":
        meta["model"] = Path(spec.path).stem
    done = [i for i in range(len(shard_items)) if (parts / f"{i:06d}.items.parquet").exists()]
    bar = tqdm(total=len(shard_items), initial=len(done), desc=f"cell shard {cell.shard}/{cell.n_shards}",
               unit="item", file=sys.stderr, disable=not cfg.get("progress", True), dynamic_ncols=True)
    for index, item in enumerate(shard_items):
        if index in done:
            continue
        item_rows, step_rows = run_item(model, tokenizer, item, prompts[index], cell, meta, timings)
        start = time.perf_counter()
        write_parquet_atomic(step_rows, parts / f"{index:06d}.steps.parquet")
        write_parquet_atomic(item_rows, parts / f"{index:06d}.items.parquet")  # written last: the commit
        timings["write"] += time.perf_counter() - start
        bar.update(1)
    bar.close()

    start = time.perf_counter()
    items_frame = pd.concat(
        [pd.read_parquet(parts / f"{i:06d}.items.parquet") for i in range(len(shard_items))], ignore_index=True
    )
    step_parts = [pd.read_parquet(parts / f"{i:06d}.steps.parquet") for i in range(len(shard_items))]
    step_parts = [p for p in step_parts if len(p)]
    steps_frame = pd.concat(step_parts, ignore_index=True) if step_parts else empty_step_table()
    write_parquet_atomic(steps_frame, out_dir / "steps.parquet")
    write_parquet_atomic(items_frame, out_dir / "items.parquet")
    write_text_atomic(OmegaConf.to_yaml(cfg, resolve=True), out_dir / "config.yaml")
    timings["write"] += time.perf_counter() - start
    timings["total"] = time.perf_counter() - wall
    manifest = build_manifest(spec, identity["items_sha256"], dict(timings), len(shard_items), len(items_frame))
    write_text_atomic(json.dumps(manifest, indent=2, sort_keys=True), out_dir / "manifest.json")
    return out_dir


__all__ = ["Configuration", "derive_seed", "run_cell", "run_item", "tokenize_item", "FULL"]

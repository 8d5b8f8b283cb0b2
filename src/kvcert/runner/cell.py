"""One experimental cell: every configuration of every item of a shard, on one shared prefill per item.

Each finished item is checkpointed under ``out_dir/.parts`` (steps first, items last, each written to a
temporary name and renamed), so a killed cell resumes at the first unfinished item with no duplicate
rows. The final tables, the resolved config and the manifest are written once every item is done.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..atomic import unwritable_reason, write_parquet_atomic, write_text_atomic
from ..calibration import Calibration, calibration_summary, prepare_calibration
from ..data import Item, is_correct, load_items, score_item, shard_items
from ..run_schema import ELIDED_AT_DEFAULT, IDENTITY_KEYS, RUN, elide_defaults
from ..errors import ConfigError
from ..generation import FULL, Prefill, decode_configurations, eos_ids, prefill
from ..kernels import attention_path
from ..models import ModelSpec, load_model, model_fingerprint
from ..policies import prefill_needs
from ..prompts import PromptIds, build_prompt, has_chat_template, model_limit
from ..provenance import code_fingerprint, sha256_file, short
from ..sampling import recording_draws
from ..table_columns import (ALLOCATOR_ITEM_COLUMNS, CALIBRATED_ITEM_COLUMNS, DEFENSE_COLUMNS, KEY_COLUMNS,
                             SHARE_COLUMNS)
from ..targets import CHOICE_COLUMNS
from .config import CellConfig, Configuration, plain_config, validate
from .decisions import LogitTops, decision_frame, draw_record, split_draws
from .manifest import build_manifest
from .shard_lock import created_dirs, remove_empty, shard_lock
from .tables import ITEM_COLUMNS, empty_step_table, logprob_summary, summarize_steps, tag_steps

PARTS = ".parts"


def item_prompt(tokenizer, item: Item, setting: str, limit: int, truncate: str, chat_template: bool = False) -> PromptIds:
    """The token ids of one item (``kvcert.prompts.build_prompt``, as ``kvcert.generate`` builds them)."""
    if not item.context or not item.context.strip():
        raise ConfigError(f"item {item.id!r}: empty context")
    if not item.answers:
        raise ConfigError(f"item {item.id!r}: no reference answers")
    return build_prompt(tokenizer, item.context, item.question, item.answer_prefix, setting=setting,
                        max_new_tokens=int(item.max_new_tokens), limit=limit, truncate=truncate,
                        name=f"item {item.id!r}", chat_template=chat_template)


def _identity(cfg: Mapping[str, Any], items: list[Item], fingerprint: str) -> dict:
    """What a resumed cell must match: ``cfg`` (a resolved run config, e.g. ``CellConfig.resolved``)'s identity
    keys, the items' hash and the code's fingerprint."""
    plain = plain_config(cfg)
    # the schema's knobs that change what a cell computes (a later key at its default left out, as in config.yaml)
    config = elide_defaults({k: plain.get(k) for k in IDENTITY_KEYS if k in plain or k not in ELIDED_AT_DEFAULT})
    calibration = config.get("calibration")
    if calibration is not None and Path(str(calibration)).is_file():  # its content, not just its name
        config["calibration"] = {"path": str(calibration), "sha256": sha256_file(calibration)}
    return {"config": config, "items_sha256": dataset_hash(items), "code_fingerprint": fingerprint}


def config_yaml(cfg) -> str:
    """A cell's config.yaml: the resolved config (an OmegaConf config or its plain dict) without the keys that
    hold a default added after committed cells (kvcert.run_schema.elide_defaults). OmegaConf.to_yaml dumps its
    container, so a config without such keys is written byte for byte as before they existed."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(elide_defaults(plain_config(cfg)))


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


def run_item(model, tokenizer, item: Item, prompt: PromptIds, cell: CellConfig, meta: dict, timings: dict,
             choices: list | None = None, decisions: list | None = None):
    """All configurations of one item from one prefill: (item rows, step frame).

    prompt: the item's token ids from ``item_prompt``; choices: with a target, collects each configuration's
    choice log (one frame of KEY_COLUMNS + kvcert.targets.CHOICE_COLUMNS per configuration); decisions: collects
    one dict per configuration, what decided its answer (kvcert.runner.decisions; DECISION_COLUMNS). Recording
    them observes the decode and repeats the selections; it changes no item or step row.
    """
    max_new = int(item.max_new_tokens)
    needs = prefill_needs(cell.all_policies, cell.policy_options)
    start = time.perf_counter()
    state: Prefill = prefill(model, prompt.prefix_ids, prompt.suffix_ids, setting=cell.setting,
                             observation_window=cell.observation_window, **needs,
                             policy_options=cell.policy_options)
    timings["prefill"] += time.perf_counter() - start
    stop = eos_ids(model, tokenizer)
    allocated = cell.allocator != RUN.allocator
    shared = cell.options.head_fraction != RUN.design_options.head_fraction
    # a default cell's tables stay as they were before allocators and certain-head shares were factors
    # the certificate's defenses (design_options.tail_mix, head_attention_share): a column each while not 0
    defenses = [name for name in DEFENSE_COLUMNS if getattr(cell.options, name) != getattr(RUN.design_options, name)]
    configuration = {**({"allocator": cell.allocator} if allocated else {}),
                     **({"head_fraction": float(cell.options.head_fraction)} if shared else {}),
                     **{name: float(getattr(cell.options, name)) for name in defenses}}
    rows, steps = [], []
    tops = LogitTops(model)
    # without a suffix the first token is chosen from the prefill's last logits, with no pass of the decode
    initial = state.last_logits if state.suffix_ids.shape[-1] == 0 else None
    for group in batches(cell.configurations()):
        start = time.perf_counter()
        recording = decisions is not None
        observing = tops.recording(initial) if recording else nullcontext()
        with observing, recording_draws() if recording else nullcontext() as draws:
            decoded_group = decode_configurations(
                model, state, group, item_id=item.id, max_new_tokens=max_new, stop_ids=stop, certify=cell.certify,
                oracle=cell.oracle, delta=cell.delta, options=cell.options, allocator=cell.allocator,
                allocator_options=cell.allocator_options, target=cell.target, calibration=cell.calibration,
            )
        timings["decode"] += time.perf_counter() - start
        drawn = split_draws(draws, group, len(state.cache.layers)) if recording else None
        for row, (conf, decoded) in enumerate(zip(group, decoded_group)):
            prediction = tokenizer.decode(decoded.token_ids, skip_special_tokens=True)
            score = float(score_item(item, prediction))
            keys = {"item_id": item.id, "policy": conf.policy, "design": conf.design, "budget": conf.budget,
                    "seed": conf.seed, "setting": cell.setting}
            if choices is not None and decoded.target_choice is not None:
                choices.append(decoded.target_choice.assign(**keys)[KEY_COLUMNS + CHOICE_COLUMNS])
            # The item row summarizes the step rows as steps.parquet stores them (float32), so that a reader who
            # recomputes cert_mean & co. from steps.parquet gets the item row's numbers exactly.
            stored = tag_steps(decoded.steps, keys) if len(decoded.steps) else decoded.steps
            rows.append({
                **keys, "task": item.task, "prediction": prediction, "score": score,
                "correct": bool(is_correct(score, item.metric)), **logprob_summary(decoded.logprobs),
                **summarize_steps(stored), "retained_tokens": decoded.retained_tokens,
                "context_tokens": state.context_tokens, "new_tokens": len(decoded.token_ids),
                "cache_bytes": decoded.cache_bytes, "full_bytes": decoded.full_bytes, "metric": item.metric, **meta,
            })
            if cell.calibration is not None:
                rows[-1].update(calibration_summary(stored))
            if allocated:
                rows[-1].update(kept_bytes=decoded.kept_bytes)
            rows[-1].update(configuration)
            if decisions is not None:
                margin, digest = drawn[row] if drawn is not None else draw_record(
                    state, conf, item_id=item.id, options=cell.options, allocator=cell.allocator,
                    allocator_options=cell.allocator_options, target=cell.target, calibration=cell.calibration)
                decisions.append({**keys, "allocator": cell.allocator, "head_fraction": float(cell.options.head_fraction),
                                  "model": meta["model"], "task": item.task, "correct": rows[-1]["correct"],
                                  **tops.decode_margin(row, decoded.token_ids), "draw_margin": margin,
                                  "draws_sha256": digest})
            if len(stored) and cell.store_steps:
                steps.append(stored.assign(**configuration) if configuration else stored)
    step_frame = pd.concat(steps, ignore_index=True) if steps else empty_step_table()
    columns = (ITEM_COLUMNS + (CALIBRATED_ITEM_COLUMNS if cell.calibration is not None else [])
               + (ALLOCATOR_ITEM_COLUMNS if allocated else []) + (SHARE_COLUMNS if shared else []) + defenses)
    return pd.DataFrame(rows)[columns], step_frame


def run_cell(cfg, out_dir: str | Path) -> Path:
    """Run one cell described by a resolved run config; returns ``out_dir`` (where the tables go; config.yaml
    records ``cfg``'s own out_dir). The config is checked once here: below, only the CellConfig travels."""
    wall = time.perf_counter()
    cell = validate(cfg)
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    # One writer per shard for the whole run (a second one ends here, naming the holder, before loading anything).
    with shard_lock(out_dir):
        return _run_cell(cell, out_dir, wall)


def _run_cell(cell: CellConfig, out_dir: Path, wall: float) -> Path:
    """``run_cell`` once the shard's writer lock is held."""
    if cell.threads:
        torch.set_num_threads(cell.threads)
    timings: dict[str, float] = defaultdict(float)
    start = time.perf_counter()
    spec = ModelSpec.parse(cell.model)
    model, tokenizer = load_model(spec)
    timings["load_model"] = time.perf_counter() - start
    if spec.kind == "hf":  # its model record is checked now: a mismatch is refused before any item runs
        model_fingerprint(spec)
    if cell.chat_template and not has_chat_template(tokenizer):  # refused before the workload is built
        raise ConfigError(f"chat_template=true: the tokenizer of model={spec.kind}"
                          f"{f' ({spec.name or spec.path})' if spec.name or spec.path else ''} has no chat template; "
                          "set chat_template=false")
    if cell.calibration is not None:  # a file of another model or design is refused before anything is written
        prepare_calibration(cell.calibration, model=model, setting=cell.setting,
                            configurations=[(c.policy, c.design, c.budget) for c in cell.configurations() if not c.is_full],
                            options=cell.options, delta=cell.delta, observation_window=cell.observation_window,
                            policy_options=cell.policy_options)
    start = time.perf_counter()
    items = load_items(cell.data.get("name"), cell.data, tokenizer, cell.n_items)
    shard = shard_items(items, cell.shard, cell.n_shards, cell.shard_by)
    timings["load_data"] = time.perf_counter() - start
    if not shard:
        raise ConfigError(f"shard={cell.shard} of n_shards={cell.n_shards} has no items (n_items={len(items)})")
    if isinstance(cell.calibration, Calibration) and cell.check_calibration_prompts:
        cell.calibration.check_prompts((item.id, item.task) for item in shard)
    limit = model_limit(model, cell.max_context_tokens)
    # Every item's prompt is tokenized (and so checked) before anything is written.
    prompts = [item_prompt(tokenizer, item, cell.setting, limit, cell.truncate, cell.chat_template) for item in shard]

    parts = out_dir / PARTS
    identity = _identity(cell.resolved, items, code_fingerprint())
    marker = parts / "identity.json"
    if marker.exists():
        _check_resumable(json.loads(marker.read_text()), identity, out_dir)
    elif parts.exists():
        shutil.rmtree(parts)  # checkpoints nobody can vouch for (their identity was removed): never reused
    created = created_dirs(parts)
    try:
        parts.mkdir(parents=True, exist_ok=True)
        write_text_atomic(json.dumps(identity, indent=1, sort_keys=True), marker)
    except OSError as err:
        remove_empty(created)
        raise ConfigError(f"out_dir={out_dir}: cannot write there ({err.strerror or err})") from None
    try:
        return _run_items(cell, spec, model, tokenizer, items, shard, prompts, parts, out_dir, identity,
                          timings, wall)
    except BaseException:
        # A failure before any item finished leaves nothing behind; finished items are kept for the rerun.
        if not any(parts.glob("*.items.parquet")):
            marker.unlink(missing_ok=True)
            for leftover in [*parts.glob(".*.tmp"), *parts.glob("*.steps.parquet"), *parts.glob("*.targets.parquet"),
                             *parts.glob("*.decisions.parquet")]:
                leftover.unlink(missing_ok=True)
            remove_empty(created)
        raise


def _check_resumable(found: dict, identity: dict, out_dir: Path) -> None:
    """Refuse checkpoints of another code fingerprint, configuration or dataset (nothing is written)."""
    old, new = found.get("code_fingerprint"), identity["code_fingerprint"]
    if old != new:
        raise ConfigError(
            f"out_dir={out_dir} holds checkpoints written by code {short(old)}, but this is code {short(new)}: "
            f"items of the two would mix; delete {out_dir / PARTS} to start over (or rerun with the code that "
            "wrote them)"
        )
    if found != json.loads(json.dumps(identity)):
        raise ConfigError(
            f"out_dir={out_dir} holds a partial run of a different configuration or dataset; "
            "use another out_dir or delete it"
        )


def check_out_dir(out_dir: Path) -> None:
    """Fail early (before loading anything) if ``out_dir`` cannot be a directory we write into."""
    reason = unwritable_reason(out_dir)
    if reason:
        raise ConfigError(f"out_dir={out_dir}: {reason}")


def _run_items(cell: CellConfig, spec, model, tokenizer, items, shard, prompts, parts, out_dir, identity, timings,
               wall):
    meta = {"model": spec.kind if spec.kind != "hf" else str(spec.name), "data": cell.data.get("name")}
    if spec.kind == "gguf":
        meta["model"] = Path(spec.path).stem
    done = [i for i in range(len(shard)) if (parts / f"{i:06d}.items.parquet").exists()]
    timings["resumed_items"] = len(done)
    bar = tqdm(total=len(shard), initial=len(done), desc=f"cell shard {cell.shard}/{cell.n_shards}",
               unit="item", file=sys.stderr, disable=not cell.progress, dynamic_ncols=True)
    for index, item in enumerate(shard):
        if index in done:
            continue
        choices = [] if cell.target is not None else None
        decisions = [] if cell.decisions else None
        item_rows, step_rows = run_item(model, tokenizer, item, prompts[index], cell, meta, timings, choices,
                                        decisions)
        start = time.perf_counter()
        if choices is not None:  # a target cell's per-item record of the chosen sizes
            write_parquet_atomic(_choice_frame(choices), parts / f"{index:06d}.targets.parquet")
        if decisions is not None:  # what decided each answer (kvcert.runner.decisions)
            write_parquet_atomic(decision_frame(decisions), parts / f"{index:06d}.decisions.parquet")
        write_parquet_atomic(step_rows, parts / f"{index:06d}.steps.parquet")
        write_parquet_atomic(item_rows, parts / f"{index:06d}.items.parquet")  # written last: the commit
        timings["write"] += time.perf_counter() - start
        bar.update(1)
    bar.close()

    start = time.perf_counter()
    items_frame = pd.concat(
        [pd.read_parquet(parts / f"{i:06d}.items.parquet") for i in range(len(shard))], ignore_index=True
    )
    step_parts = [pd.read_parquet(parts / f"{i:06d}.steps.parquet") for i in range(len(shard))]
    step_parts = [p for p in step_parts if len(p)]
    steps_frame = pd.concat(step_parts, ignore_index=True) if step_parts else empty_step_table()
    outputs = {"steps.parquet": out_dir / "steps.parquet", "items.parquet": out_dir / "items.parquet",
               "config.yaml": out_dir / "config.yaml"}
    if cell.target is not None:
        outputs["targets.parquet"] = out_dir / "targets.parquet"
        write_parquet_atomic(pd.concat([pd.read_parquet(parts / f"{i:06d}.targets.parquet") for i in range(len(shard))],
                                       ignore_index=True), outputs["targets.parquet"])
    if cell.decisions:
        outputs["decisions.parquet"] = out_dir / "decisions.parquet"
        write_parquet_atomic(pd.concat([pd.read_parquet(parts / f"{i:06d}.decisions.parquet") for i in range(len(shard))],
                                       ignore_index=True), outputs["decisions.parquet"])
    write_parquet_atomic(steps_frame, outputs["steps.parquet"])
    write_parquet_atomic(items_frame, outputs["items.parquet"])
    write_text_atomic(config_yaml(cell.resolved), outputs["config.yaml"])
    timings["write"] += time.perf_counter() - start
    timings["total"] = time.perf_counter() - wall
    parameter = next(model.parameters())
    certified = (cell.certify or cell.oracle) and any(not c.is_full for c in cell.configurations())
    path = attention_path(parameter.dtype, parameter.device).as_dict() if certified else None
    manifest = build_manifest(spec, model, identity["items_sha256"], dict(timings), len(shard),
                              len(items_frame), path, outputs, fingerprint=identity["code_fingerprint"])
    write_text_atomic(json.dumps(manifest, indent=2, sort_keys=True), out_dir / "manifest.json")
    # The cell is complete: its checkpoints are redundant, and a later run (another code, another config)
    # must start from nothing rather than find them.
    shutil.rmtree(parts)
    return out_dir


def _choice_frame(choices: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(choices, ignore_index=True) if choices else pd.DataFrame(columns=KEY_COLUMNS + CHOICE_COLUMNS)



__all__ = ["Configuration", "FULL", "item_prompt", "run_cell", "run_item"]

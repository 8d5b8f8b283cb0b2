"""Running ``kvcert-run`` as a subprocess and checking the tables of a cell, for the runner tests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

# The columns the runner documents (kvcert.runner.tables); a cell must have at least these.
ITEM_COLUMNS = [
    "item_id", "task", "policy", "design", "budget", "seed", "setting", "prediction", "score", "correct",
    "logprob_mean", "logprob_min", "logprob_first", "cert_mean", "cert_max", "true_err_mean", "true_err_max",
    "retained_tokens", "context_tokens", "new_tokens", "cache_bytes", "full_bytes", "metric", "model", "data",
]
KEY_COLUMNS = ["item_id", "policy", "design", "budget", "seed", "setting"]
STEP_COLUMNS = KEY_COLUMNS + [
    "step", "layer", "kv_head", "trace_var", "cert", "true_err", "rel_cert", "rel_err", "coverage", "wald_coverage",
]


def kvcert_run_command() -> list[str]:
    """The installed console script next to this interpreter, else the module it wraps."""
    script = Path(sys.executable).with_name("kvcert-run")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvcert.runner.cli"]


def run_cell(overrides: list[str], *, env: dict[str, str] | None = None, timeout: float = 600,
             check: bool = True) -> subprocess.CompletedProcess:
    """``kvcert-run OVERRIDES`` in a fresh process; with ``check``, fails the test with its stderr when rc != 0."""
    full_env = {**os.environ, **(env or {}), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(kvcert_run_command() + ["progress=false", *overrides], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    if check and proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        raise AssertionError(f"kvcert-run exited {proc.returncode}:\n{tail}")
    return proc


def expected_configurations(policies, designs, budgets, seeds) -> set[tuple]:
    """(policy, design, budget, seed) of a grid, the full reference included; deterministic designs once."""
    out = {("full", "full", 1.0, 0)}
    for p in policies:
        for d in designs:
            for b in budgets:
                for s in (seeds if d == "poisson" else [0]):
                    out.add((p, d, float(b), int(s)))
    return out


def load_cell(out_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    out_dir = Path(out_dir)
    for name in ("items.parquet", "steps.parquet", "config.yaml", "manifest.json"):
        assert (out_dir / name).is_file(), f"{name} missing in {out_dir}"
    return (pd.read_parquet(out_dir / "items.parquet"), pd.read_parquet(out_dir / "steps.parquet"),
            json.loads((out_dir / "manifest.json").read_text()))


def check_cell(
    out_dir: Path,
    *,
    item_ids: list[str],
    configurations: set[tuple],
    setting: str,
    num_layers: int,
    num_kv_heads: int,
    max_new_tokens: dict[str, int] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Everything a cell promises about its tables, for any model and workload."""
    items, steps, manifest = load_cell(out_dir)
    missing = [c for c in ITEM_COLUMNS if c not in items.columns]
    assert not missing, f"items.parquet lacks documented columns {missing}"
    assert len(items) == len(item_ids) * len(configurations), (len(items), len(item_ids), len(configurations))
    assert sorted(items["item_id"].unique()) == sorted(item_ids)
    assert (items["setting"] == setting).all()
    assert not items[KEY_COLUMNS].duplicated().any(), "duplicate item × configuration rows"

    for item_id, rows in items.groupby("item_id"):
        got = {(r.policy, r.design, float(r.budget), int(r.seed)) for r in rows.itertuples()}
        assert got == configurations, f"item {item_id}: configurations {sorted(got ^ configurations)} differ"
        full = rows[rows["policy"] == "full"]
        assert len(full) == 1, f"item {item_id}: {len(full)} full-cache rows"
        # One full row: no nulls where the full cache has values.
        row = full.iloc[0]
        for column in ("prediction", "score", "correct", "logprob_mean", "logprob_min", "logprob_first",
                       "retained_tokens", "context_tokens", "new_tokens", "cache_bytes", "full_bytes",
                       "metric", "model", "data", "task"):
            assert row[column] is not None and not (isinstance(row[column], float) and math.isnan(row[column])), \
                f"item {item_id}: full row has no {column}"
        assert row["cache_bytes"] == row["full_bytes"]
        assert row["retained_tokens"] == row["context_tokens"]
        assert rows["context_tokens"].nunique() == 1, "configurations of one item saw different prompts"
        if max_new_tokens is not None:
            assert rows["new_tokens"].between(1, max_new_tokens[item_id]).all()

    assert items["score"].between(0, 100).all()
    for column in ("logprob_mean", "logprob_min", "logprob_first"):
        values = items[column].to_numpy(dtype=float)
        assert np.isfinite(values).all() and (values <= 1e-6).all(), column
    assert (items["cache_bytes"] <= items["full_bytes"]).all()
    assert (items["retained_tokens"] <= items["context_tokens"]).all()
    assert (items["retained_tokens"] > 0).all()

    missing = [c for c in STEP_COLUMNS if c not in steps.columns]
    assert not missing, f"steps.parquet lacks documented columns {missing}"
    assert len(steps) > 0

    # Which item × configuration rows attended to a compressed cache at all. In the question-aware setting
    # the first token comes from the uncompressed prefill, so an answer that stops there (EOS first) has no
    # compressed step and hence no certificate; every other compressed row has steps.
    with_steps = set(steps.groupby(KEY_COLUMNS).size().index)
    has_steps = np.array([tuple(k) in with_steps for k in items[KEY_COLUMNS].itertuples(index=False)])
    compressed = items["policy"] != "full"
    may_lack = (items["setting"] == "question_aware") & (items["new_tokens"] == 1)
    assert not (has_steps & ~compressed).any(), "the full cache has no step rows"
    lacking = items[compressed & ~has_steps & ~may_lack]
    assert lacking.empty, f"compressed rows without step rows: {lacking[KEY_COLUMNS].to_dict('records')}"
    assert has_steps[compressed.to_numpy()].mean() > 0.5, "most compressed configurations decode past the prefill"

    certified = items[has_steps]
    poisson = certified[certified["design"] == "poisson"]
    assert len(poisson) > 0
    for column in ("cert_mean", "cert_max"):
        values = poisson[column].to_numpy(dtype=float)
        assert np.isfinite(values).all() and (values >= 0).all(), f"poisson rows: {column} not finite >= 0"
    assert items[items["design"] != "poisson"]["cert_mean"].isna().all(), "deterministic designs carry no certificate"
    assert items[~has_steps]["cert_mean"].isna().all()
    for column in ("true_err_mean", "true_err_max"):  # oracle=true by default
        values = certified[column].to_numpy(dtype=float)
        assert np.isfinite(values).all() and (values >= 0).all(), column
    assert set(steps["layer"].unique()) <= set(range(num_layers))
    assert set(steps["kv_head"].unique()) <= set(range(num_kv_heads))
    assert set(steps["layer"].unique()) == set(range(num_layers)), "every compressed layer records its steps"
    assert set(steps["kv_head"].unique()) == set(range(num_kv_heads))
    assert (steps["policy"] != "full").all(), "the full cache has no step rows"
    assert (steps["setting"] == setting).all()
    assert (steps["step"] >= 0).all()
    poisson_steps = steps[steps["design"] == "poisson"]
    cert = poisson_steps["cert"].to_numpy(dtype=float)
    assert np.isfinite(cert).all() and (cert >= 0).all()
    assert np.isfinite(poisson_steps["trace_var"].to_numpy(dtype=float)).all()
    err = steps["true_err"].to_numpy(dtype=float)
    assert np.isfinite(err).all() and (err >= 0).all()
    assert steps[steps["design"] == "topk"]["cert"].isna().all()

    assert manifest["n_shard_items"] == len(item_ids)
    assert manifest["n_item_rows"] == len(items)
    return items, steps, manifest

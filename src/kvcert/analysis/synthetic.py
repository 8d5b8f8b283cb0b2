"""Synthetic cell tables in the runner's exact schema, for testing the analysis logic.

Nothing here models a language model: items succeed or fail by coin flips whose rates, and the
strength with which the certificate and the confidence track those failures, are knobs. Tests use
it to build data where a claim must come out supported, and data where it must not.

Generative story per item i: the full cache answers correctly with probability ``p_full``. A
compressed run additionally fails "because of the cache" with probability ``drop(setting, design,
budget)``; its certificate is multiplied by ``1 + cert_signal`` when that happened, and its mean
log-probability is lowered by ``conf_signal`` whenever the run fails (for any reason).
Step rows: sigma ~ lognormal per row, trace_var = sigma^2, true_err = err_scale * sigma * lognormal
noise, so coverage of sqrt(trace_var/0.05) is high iff err_scale < sqrt(20).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

DELTA = 0.05


def default_drop(setting: str, design: str, budget: float) -> float:
    """Probability that compression alone makes a run fail."""
    base = 0.25 if setting == "streaming" else 0.03
    return base * (0.5 / budget) * (1.0 if design != "uniform" else 4.0)


@dataclass
class SynthSpec:
    """Knobs of the synthetic population (see module docstring)."""

    n_items: int = 200
    seed: int = 0
    settings: tuple = ("question_aware", "streaming")
    policies: tuple = ("snapkv",)
    budgets: tuple = (0.25, 0.5)
    n_seeds: int = 3
    p_full: float = 0.6
    drop: Callable[[str, str, float], float] = field(default=default_drop)
    cert_signal: float = 2.0
    conf_signal: float = 0.0
    uniform: bool = True
    steps: bool = True
    oracle: bool = True
    err_scale: float = 1.0
    err_noise: float = 0.15
    n_step_rows: tuple = (2, 2, 2)  # steps, layers, kv heads per run
    model: str = "synthetic-model"
    data: str = "synthetic-passkey"


def _configs(spec: SynthSpec):
    """(setting, policy, design, budget, seeds) of every compressed configuration."""
    for s in spec.settings:
        for p in spec.policies:
            for b in spec.budgets:
                yield s, p, "topk", b, [0]
                yield s, p, "poisson", b, list(range(spec.n_seeds))
        if spec.uniform:
            for b in spec.budgets:
                yield s, "uniform", "poisson", b, list(range(spec.n_seeds))


def make_tables(spec: SynthSpec | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(items, steps) DataFrames for one synthetic cell."""
    spec = spec or SynthSpec()
    rng = np.random.default_rng(spec.seed)
    n = spec.n_items
    ids = np.array([f"item{i:04d}" for i in range(n)])
    full_ok = rng.random(n) < spec.p_full
    item_frames, step_frames = [], []

    def conf(ok):
        return -0.5 + 0.2 * rng.standard_normal(len(ok)) - spec.conf_signal * (~ok)

    for s in spec.settings:
        item_frames.append(_item_frame(ids, s, "full", "full", 1.0, -1, full_ok, conf(full_ok),
                                       np.full(n, np.nan), spec))
    for s, p, d, b, seeds in _configs(spec):
        kind = "uniform" if p == "uniform" else d
        for k in seeds:
            cache_fail = rng.random(n) < spec.drop(s, kind, b)
            ok = full_ok & ~cache_fail
            cert = np.full(n, np.nan)
            if d == "poisson":
                cert = 0.05 * np.exp(0.3 * rng.standard_normal(n)) * (1 + spec.cert_signal * cache_fail)
            item_frames.append(_item_frame(ids, s, p, d, b, k, ok, conf(ok), cert, spec))
            if spec.steps:
                step_frames.append(_step_frame(rng, ids, s, p, d, b, k, kind, spec))
    items = pd.concat(item_frames, ignore_index=True)
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame()
    return items, steps


def _item_frame(ids, setting, policy, design, budget, seed, ok, logprob, cert, spec: SynthSpec) -> pd.DataFrame:
    n = len(ids)
    return pd.DataFrame({
        "item_id": ids, "task": "passkey", "policy": policy, "design": design,
        "budget": float(budget), "seed": int(seed), "setting": setting,
        "prediction": np.where(ok, "12345", "00000"), "score": ok.astype(float), "correct": ok,
        "logprob_mean": logprob, "logprob_min": logprob - 1.0, "logprob_first": logprob,
        "cert_mean": cert, "cert_max": 3 * cert, "true_err_mean": np.full(n, 0.01),
        "true_err_max": np.full(n, 0.05), "retained_tokens": int(1000 * budget), "context_tokens": 1000,
        "model": spec.model, "data": spec.data,
    })


def _step_frame(rng, ids, setting, policy, design, budget, seed, kind, spec: SynthSpec) -> pd.DataFrame:
    n_steps, n_layers, n_heads = spec.n_step_rows
    per_run = n_steps * n_layers * n_heads
    m = len(ids) * per_run
    grid = np.indices((len(ids), n_steps, n_layers, n_heads)).reshape(4, -1)
    scale = {"poisson": 1.0, "topk": 1.4, "uniform": 7.0}[kind]
    sigma = 0.03 * np.exp(rng.standard_normal(m)) * scale * (0.25 / budget)
    true_err = spec.err_scale * sigma * np.exp(spec.err_noise * rng.standard_normal(m))
    if kind == "topk":
        trace_var = np.zeros(m)
        cert = np.full(m, np.nan)
    else:
        trace_var = sigma ** 2
        cert = np.sqrt(trace_var / DELTA)
    if not spec.oracle:
        true_err = np.full(m, np.nan)
    norm = np.ones(m)
    return pd.DataFrame({
        "item_id": ids[grid[0]], "policy": policy, "design": design, "budget": float(budget),
        "seed": int(seed), "setting": setting, "step": grid[1], "layer": grid[2], "kv_head": grid[3],
        "trace_var": trace_var, "cert": cert, "true_err": true_err, "rel_cert": cert / norm,
        "rel_err": true_err / norm, "coverage": true_err <= cert,
        "wald_coverage": np.clip(0.9 + 0.05 * rng.standard_normal(m), 0, 1),
        "model": spec.model, "data": spec.data,
    })


def write_cell(directory: str | Path, spec: SynthSpec | None = None) -> Path:
    """Write items.parquet and steps.parquet of a synthetic cell; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items, steps = make_tables(spec)
    items.to_parquet(directory / "items.parquet", index=False)
    steps.to_parquet(directory / "steps.parquet", index=False)
    return directory

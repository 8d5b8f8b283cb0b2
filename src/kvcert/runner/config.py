"""Validation of a cell's configuration: every bad key gets one line naming it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..calibration import load_calibration
from ..data import SHARD_BY
from ..designs import DESIGNS, DesignOptions
from ..errors import ConfigError
from ..generation import FULL
from ..policies import POLICIES
from ..policies.base import renamed_hint
from ..prompts import SETTINGS, TRUNCATE


@dataclass(frozen=True)
class Configuration:
    """One compared configuration of a cell (the full cache has policy == design == "full")."""

    policy: str
    design: str
    budget: float
    seed: int

    @property
    def is_full(self) -> bool:
        return self.policy == FULL


@dataclass(frozen=True)
class CellConfig:
    """The validated knobs of one cell (see configs/run.yaml for their meaning)."""

    policies: tuple[str, ...]
    designs: tuple[str, ...]
    budgets: tuple[float, ...]
    seeds: tuple[int, ...]
    setting: str
    n_items: int
    shard: int
    n_shards: int
    oracle: bool
    certify: bool
    delta: float
    observation_window: int
    options: DesignOptions
    max_context_tokens: int | None
    truncate: str
    extra_grids: tuple[Grid, ...] = ()
    store_steps: bool = True
    policy_options: dict = field(default_factory=dict)
    calibration: object = None  # None, "design", or a kvcert.calibration.Calibration (checked against the model later)
    shard_by: str = "item"  # kvcert.data.shard_items: "item" or "task"
    check_calibration_prompts: bool = True  # refuse calibration prompts and unseen tasks among a run's prompts

    @property
    def grids(self) -> tuple[Grid, ...]:
        return (Grid(self.policies, self.designs, self.budgets, self.seeds), *self.extra_grids)

    @property
    def all_policies(self) -> set[str]:
        return {p for grid in self.grids for p in grid.policies}

    def configurations(self) -> list[Configuration]:
        """The full cache first, then each grid's policy × design × budget × seed, without repeats."""
        out = [Configuration(FULL, FULL, 1.0, 0)]
        for grid in self.grids:
            for conf in grid.configurations():
                if conf not in out:
                    out.append(conf)
        return out


@dataclass(frozen=True)
class Grid:
    """policy × design × budget × seed; deterministic designs run once (seed 0)."""

    policies: tuple[str, ...]
    designs: tuple[str, ...]
    budgets: tuple[float, ...]
    seeds: tuple[int, ...]

    def configurations(self) -> list[Configuration]:
        out = []
        for policy in self.policies:
            for design in self.designs:
                seeds = self.seeds if design == "poisson" else (0,)
                for budget in self.budgets:
                    out.extend(Configuration(policy, design, budget, seed) for seed in seeds)
        return out


def _names(cfg: Mapping[str, Any], key: str, known, prefix: str = "") -> tuple[str, ...]:
    values = cfg.get(key)
    name = f"{prefix}.{key}" if prefix else key
    if values is None or isinstance(values, (str, int, float)) or len(values) == 0:
        example = values if isinstance(values, str) and values in known else sorted(known)[0]
        raise ConfigError(f"{name}={values!r}: expected a non-empty list, e.g. '{key}=[{example}]'")
    for value in values:
        if value not in known:
            raise ConfigError(f"{name}: {value!r} is unknown; known: {sorted(known)}{renamed_hint(str(value))}")
    return tuple(str(v) for v in values)


def _number(cfg, key, kind, low=None, high=None, low_open=False, label=None):
    value = cfg.get(key)
    label = label or key
    try:
        if isinstance(value, bool) or value is None:
            raise TypeError
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise TypeError
        value = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{label}={cfg.get(key)!r}: expected {kind.__name__}") from None
    if value != value:  # nan
        raise ConfigError(f"{label}={value}: expected a number")
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(f"{label}={value}: must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise ConfigError(f"{label}={value}: must be <= {high}")
    return value


def _budgets(cfg: Mapping[str, Any], key: str) -> tuple[float, ...]:
    budgets = cfg.get("budgets")
    if budgets is None or isinstance(budgets, (str, int, float)) or len(budgets) == 0:
        raise ConfigError(f"{key}={budgets!r}: expected a non-empty list of fractions in (0, 1], e.g. '{key}=[0.25,0.5]'")
    checked = []
    for b in budgets:
        try:
            if isinstance(b, bool):
                raise TypeError
            b = float(b)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: {b!r} is not a number") from None
        if not 0.0 < b <= 1.0:  # also rejects nan
            raise ConfigError(f"{key}: {b} is outside (0, 1]")
        checked.append(b)
    return tuple(checked)


def _seeds(cfg: Mapping[str, Any], key: str) -> tuple[int, ...]:
    seeds = cfg.get("seeds")
    if seeds is None or isinstance(seeds, (str, int, float)) or len(seeds) == 0:
        raise ConfigError(f"{key}={seeds!r}: expected a non-empty list of integers, e.g. '{key}=[0,1]'")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ConfigError(f"{key}: {s!r} is not an integer")
    return tuple(int(s) for s in seeds)


def _flag(cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false")
    return value


def _design_options(cfg: Mapping[str, Any]) -> DesignOptions:
    opts = cfg.get("design_options") or {}
    if not isinstance(opts, Mapping):
        raise ConfigError(f"design_options={opts!r}: expected a mapping of {sorted(DesignOptions.__dataclass_fields__)}")
    unknown = set(opts) - set(DesignOptions.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"design_options: unknown key(s) {sorted(unknown)}; known: {sorted(DesignOptions.__dataclass_fields__)}")
    values = {}
    for name, kind in (("n_sink", int), ("n_recent", int), ("head_fraction", float), ("pi_min", float)):
        if name in opts:
            values[name] = _number(opts, name, kind, label=f"design_options.{name}")
    return DesignOptions(**values)


def _policy_options(cfg: Mapping[str, Any]) -> dict:
    """``policy_options``: {policy: {option: value}} for registered policies and their dataclass fields."""
    raw = cfg.get("policy_options") or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"policy_options={raw!r}: expected a mapping, e.g. 'policy_options={{snapkv: {{kernel_size: 7}}}}'")
    out = {}
    for name, options in raw.items():
        if name not in POLICIES:
            raise ConfigError(f"policy_options.{name}: {name!r} is not a policy; known: {sorted(POLICIES)}")
        fields = {f.name: f for f in dataclasses.fields(POLICIES[name])} if dataclasses.is_dataclass(POLICIES[name]) else {}
        if not isinstance(options, Mapping):
            raise ConfigError(f"policy_options.{name}={options!r}: expected a mapping of {sorted(fields)}")
        for key, value in options.items():
            if key not in fields:
                raise ConfigError(f"policy_options.{name}.{key}: unknown option; known: {sorted(fields) or 'none'}")
            kind = type(fields[key].default)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ConfigError(f"policy_options.{name}.{key}={value!r}: expected {kind.__name__}")
        try:
            POLICIES[name](**options).score  # noqa: B018 - construct it: the dataclass checks its own values
        except (TypeError, ValueError) as err:
            raise ConfigError(f"policy_options.{name}: {err}") from None
        out[str(name)] = dict(options)
    return out


def _extra_grids(cfg: Mapping[str, Any], seeds: tuple[int, ...]) -> tuple[Grid, ...]:
    grids = []
    for i, grid in enumerate(cfg.get("extra_grids") or []):
        key = f"extra_grids[{i}]"
        if not isinstance(grid, Mapping):
            raise ConfigError(f"{key}={grid!r}: expected a mapping with policies, designs, budgets[, seeds]")
        unknown = set(grid) - {"policies", "designs", "budgets", "seeds"}
        if unknown:
            raise ConfigError(f"{key}: unknown keys {sorted(unknown)}")
        grids.append(Grid(
            policies=_names(grid, "policies", set(POLICIES), key),
            designs=_names(grid, "designs", set(DESIGNS), key),
            budgets=_budgets(grid, f"{key}.budgets"),
            seeds=_seeds(grid, f"{key}.seeds") if grid.get("seeds") is not None else seeds,
        ))
    return tuple(grids)


def validate(cfg: Mapping[str, Any]) -> CellConfig:
    """Check a resolved run config; raises ConfigError naming the first bad key."""
    checked_budgets = _budgets(cfg, "budgets")
    seeds = _seeds(cfg, "seeds")
    setting = cfg.get("setting")
    if setting not in SETTINGS:
        raise ConfigError(f"setting={setting!r} is unknown; known: {list(SETTINGS)}")
    n_shards = _number(cfg, "n_shards", int, low=1)
    shard = _number(cfg, "shard", int, low=0)
    if shard >= n_shards:
        raise ConfigError(f"shard={shard}: must be < n_shards={n_shards}")
    shard_by = cfg.get("shard_by", "item")  # configs written before the key existed sharded by item
    if shard_by not in SHARD_BY:
        raise ConfigError(f"shard_by={shard_by!r} is unknown; known: {list(SHARD_BY)}")
    truncate = cfg.get("truncate")
    if truncate not in TRUNCATE:
        raise ConfigError(f"truncate={truncate!r} is unknown; known: {list(TRUNCATE)}")
    max_ctx = cfg.get("max_context_tokens")
    options = _design_options(cfg)
    if not 0.0 < options.pi_min <= 1.0:
        raise ConfigError(f"design_options.pi_min={options.pi_min}: must lie in (0, 1]")
    if not 0.0 <= options.head_fraction <= 1.0:
        raise ConfigError(f"design_options.head_fraction={options.head_fraction}: must lie in [0, 1]")
    if options.n_sink < 0 or options.n_recent < 1:
        raise ConfigError("design_options: n_sink must be >= 0 and n_recent >= 1")
    threads = cfg.get("threads")
    if threads is not None:
        _number(cfg, "threads", int, low=1)
    if cfg.get("progress") is not None:
        _flag(cfg, "progress")
    return CellConfig(
        policies=_names(cfg, "policies", set(POLICIES)),
        designs=_names(cfg, "designs", set(DESIGNS)),
        budgets=tuple(checked_budgets),
        seeds=seeds,
        setting=setting,
        n_items=_number(cfg, "n_items", int, low=1),
        shard=shard,
        n_shards=n_shards,
        oracle=_flag(cfg, "oracle"),
        certify=_flag(cfg, "certify"),
        delta=_number(cfg, "delta", float, low=0.0, high=0.999, low_open=True),
        observation_window=_number(cfg, "observation_window", int, low=1),
        options=options,
        max_context_tokens=None if max_ctx is None else _number(cfg, "max_context_tokens", int, low=8),
        truncate=truncate,
        extra_grids=_extra_grids(cfg, seeds),
        store_steps=_flag(cfg, "store_steps", True),
        policy_options=_policy_options(cfg),
        calibration=load_calibration(cfg.get("calibration")),
        shard_by=shard_by,
        check_calibration_prompts=_flag(cfg, "check_calibration_prompts", True),
    )

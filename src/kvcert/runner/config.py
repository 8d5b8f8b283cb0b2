"""Validation of a cell's configuration against its schema (``kvcert.run_schema.RunConfig``): every bad key gets
one line naming the key and the value. What each field takes (its type, bounds, registry) is read from the
schema; this module knows only the registries' contents and the checks no type can state."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Mapping

from .. import run_schema as schema
from ..allocators import ALLOCATORS
from ..calibration import BASES, UNITS, load_calibration
from ..data import SHARD_BY
from ..designs import DESIGNS, RANDOM_DESIGNS, check_design_defenses
from ..errors import ConfigError
from ..generation import FULL, Configuration  # a cell's configurations are the library's
from ..policies import POLICIES
from ..policies.base import renamed_hint
from ..prompts import SETTINGS, TRUNCATE
from ..targets import Target, calibrated_scales, check_target

# The names a ``known`` field of the schema takes.
KNOWN = {"policies": POLICIES, "designs": DESIGNS, "setting": SETTINGS, "shard_by": SHARD_BY, "truncate": TRUNCATE,
         "unit": UNITS, "base": BASES, "allocator": ALLOCATORS}


@dataclass
class CellConfig(schema.RunConfig):
    """A checked ``RunConfig``, the one config object below ``run_cell``: lists are tuples, ``extra_grids`` are
    ``Grid``s, ``data``/``model`` plain mappings, ``calibration`` is None, "design" or a loaded
    kvcert.calibration.Calibration (checked against the model later); ``resolved`` is the resolved config it was
    checked from, as plain data in its key order (what config.yaml and the cell's identity record)."""

    resolved: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def options(self) -> schema.DesignOptions:
        """The checked ``design_options`` (already the library's immutable value)."""
        return self.design_options

    @property
    def target(self) -> Target | None:
        """The target of ``target_error``/``target_delta`` (design poisson), or None for fixed budgets."""
        return check_target("poisson", self.target_error, self.target_delta, self.target_floor)

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
                seeds = self.seeds if design in RANDOM_DESIGNS else (0,)
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


def _number(cfg, key, kind, low=None, high=None, low_open=False, label=None, lie_in=False):
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
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if lie_in and (too_low or too_high):
        raise ConfigError(f"{label}={value}: must lie in {_interval(low, high, low_open)}")
    if too_low:
        raise ConfigError(f"{label}={value}: must be {'>' if low_open else '>='} {low}")
    if too_high:
        raise ConfigError(f"{label}={value}: must be <= {high}")
    return value


def _interval(low, high, low_open) -> str:
    return f"{'(' if low_open else '['}{low}, {high}]"


def _fractions(cfg: Mapping[str, Any], key: str, label: str, bounds: Mapping) -> tuple[float, ...]:
    values = cfg.get(key)
    interval = _interval(bounds["low"], bounds["high"], bounds["low_open"])
    if values is None or isinstance(values, (str, int, float)) or len(values) == 0:
        raise ConfigError(f"{label}={values!r}: expected a non-empty list of fractions in {interval}, "
                          f"e.g. '{label}=[0.25,0.5]'")
    checked = []
    for b in values:
        try:
            if isinstance(b, bool):
                raise TypeError
            b = float(b)
        except (TypeError, ValueError):
            raise ConfigError(f"{label}: {b!r} is not a number") from None
        if not bounds["low"] < b <= bounds["high"]:  # also rejects nan
            raise ConfigError(f"{label}: {b} is outside {interval}")
        checked.append(b)
    return tuple(checked)


def _integers(cfg: Mapping[str, Any], key: str, label: str) -> tuple[int, ...]:
    values = cfg.get(key)
    if values is None or isinstance(values, (str, int, float)) or len(values) == 0:
        raise ConfigError(f"{label}={values!r}: expected a non-empty list of integers, e.g. '{label}=[0,1]'")
    for s in values:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ConfigError(f"{label}: {s!r} is not an integer")
    return tuple(int(s) for s in values)


def _flag(cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false")
    return value


def _hints(schema_type: type) -> dict[str, Any]:
    return typing.get_type_hints(schema_type, vars(schema))


def _check(f: dataclasses.Field, kind: Any, cfg: Mapping[str, Any], label: str) -> Any:
    """One field of the schema: ``kind`` is its type, ``f.metadata`` its bounds and registry."""
    key, meta = f.name, f.metadata
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union and type(None) in args:  # Optional[X]
        if cfg.get(key) is None:
            return None
        kind = next(a for a in args if a is not type(None))
        args = typing.get_args(kind)
    bounds = {"low": meta.get("low"), "high": meta.get("high"), "low_open": meta.get("low_open", False)}
    if kind is bool:
        return _flag(cfg, key, f.default)
    if kind in (int, float):
        return _number(cfg, key, kind, label=label, lie_in=meta.get("lie_in", False), **bounds)
    if meta.get("known") and kind is str:
        value = cfg.get(key)
        known = KNOWN[key]
        if value not in known:
            raise ConfigError(f"{label}={value!r} is unknown; known: {list(known)}")
        return value
    if meta.get("known"):
        return _names(cfg, key, set(KNOWN[key]), label.rpartition(".")[0] if "." in label else "")
    if typing.get_origin(kind) is list and args == (float,):
        return _fractions(cfg, key, label, bounds)
    if typing.get_origin(kind) is list and args == (int,):
        return _integers(cfg, key, label)
    if dataclasses.is_dataclass(kind):
        return _nested(cfg.get(key), kind, label)
    return cfg.get(key)


def _nested(raw: Any, kind: type, label: str) -> Any:
    """A mapping checked against a dataclass of the schema (``design_options``); missing keys take its defaults."""
    raw = raw or {}
    fields = {f.name: f for f in dataclasses.fields(kind)}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{label}={raw!r}: expected a mapping of {sorted(fields)}")
    unknown = set(raw) - set(fields)
    if unknown:
        raise ConfigError(f"{label}: unknown key(s) {sorted(unknown)}; known: {sorted(fields)}")
    hints = _hints(kind)
    return kind(**{name: _check(f, hints[name], raw, f"{label}.{name}") for name, f in fields.items() if name in raw})


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
            if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):  # bool is an int
                raise ConfigError(f"policy_options.{name}.{key}={value!r}: expected {kind.__name__}")
        try:
            POLICIES[name](**options).score  # noqa: B018 - construct it: the dataclass checks its own values
        except (TypeError, ValueError) as err:
            raise ConfigError(f"policy_options.{name}: {err}") from None
        out[str(name)] = dict(options)
    return out


def _allocator_options(cfg: Mapping[str, Any], allocator: str) -> dict:
    """``allocator_options``: {option: value} of the chosen allocator's dataclass fields."""
    raw = cfg.get("allocator_options") or {}
    fields = {f.name: f for f in dataclasses.fields(ALLOCATORS[allocator])}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"allocator_options={raw!r}: expected a mapping of {sorted(fields) or 'nothing'}")
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"allocator_options.{key}: not an option of allocator={allocator}; known: "
                              f"{sorted(fields) or 'none'}")
        default = fields[key].default
        kinds = (int, float) if isinstance(default, float) or default is None else (type(default),)
        if isinstance(value, bool) or not (isinstance(value, kinds) or (value is None and default is None)):
            raise ConfigError(f"allocator_options.{key}={value!r}: expected a number")
    try:
        ALLOCATORS[allocator](**raw)  # the dataclass checks its own values
    except (TypeError, ValueError) as err:
        raise ConfigError(f"allocator_options: {err}") from None
    return dict(raw)


def _extra_grids(cfg: Mapping[str, Any], seeds: tuple[int, ...]) -> tuple[Grid, ...]:
    fields = {f.name: f for f in dataclasses.fields(schema.GridKnobs)}
    hints = _hints(schema.GridKnobs)
    grids = []
    for i, grid in enumerate(cfg.get("extra_grids") or []):
        key = f"extra_grids[{i}]"
        if not isinstance(grid, Mapping):
            raise ConfigError(f"{key}={grid!r}: expected a mapping with policies, designs, budgets[, seeds]")
        unknown = set(grid) - set(fields)
        if unknown:
            raise ConfigError(f"{key}: unknown keys {sorted(unknown)}")
        checked = {name: _check(f, hints[name], grid, f"{key}.{name}") for name, f in fields.items()}
        grids.append(Grid(**{**checked, "seeds": checked["seeds"] or seeds}))
    return tuple(grids)


def check_keys(schema_type: type, cfg: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``{key: checked value}`` of some fields of a schema dataclass (a key ``cfg`` lacks takes its default)."""
    hints = _hints(schema_type)
    fields = {f.name: f for f in dataclasses.fields(schema_type)}
    return {key: _check(fields[key], hints[key], cfg if key in cfg else _default(fields[key]), key) for key in keys}


# Checked after every other key (in this order), or not by their type: the groups have their own loaders.
_LATER = ("extra_grids", "policy_options", "allocator_options", "calibration")
_GROUPS = ("defaults", "data", "model")


def plain_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A run config as plain data, interpolations resolved (an OmegaConf config converted; a dict as it is)."""
    if isinstance(cfg, dict):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def validate(cfg: Mapping[str, Any]) -> CellConfig:
    """Check a resolved run config (composed, or a cell's config.yaml read back; a key it lacks takes the
    schema's default); raises ConfigError naming the first bad key. The config is read as plain data (its
    OmegaConf form goes no further than here)."""
    hints = _hints(schema.RunConfig)
    plain = plain_config(cfg)
    checked: dict[str, Any] = {"resolved": plain}
    for f in dataclasses.fields(schema.RunConfig):
        if f.name in _GROUPS:
            checked[f.name] = plain.get(f.name, {})
        elif f.name not in _LATER:
            checked[f.name] = _check(f, hints[f.name], plain if f.name in plain else _default(f), f.name)
    if checked["shard"] >= checked["n_shards"]:
        raise ConfigError(f"shard={checked['shard']}: must be < n_shards={checked['n_shards']}")
    checked["extra_grids"] = _extra_grids(plain, checked["seeds"])
    checked["policy_options"] = _policy_options(plain)
    checked["allocator_options"] = _allocator_options(plain, checked["allocator"])
    if checked["allocator"] != schema.RUN.allocator and plain.get("calibration") is not None:
        raise ConfigError(f"allocator={checked['allocator']}: a calibration's factors are fitted under the uniform "
                          "allocator; drop calibration or the allocator")
    checked["calibration"] = load_calibration(plain.get("calibration"))
    cell = CellConfig(**checked)
    _check_target(cell)
    _check_defenses(cell)
    return cell


def _check_defenses(cell: CellConfig) -> None:
    """The certificate's defenses (design_options.tail_mix, head_attention_share) apply to design poisson: a grid
    with another design is refused while either is on (kvcert.designs.check_design_defenses)."""
    try:
        for design in sorted({d for grid in cell.grids for d in grid.designs}):
            check_design_defenses(design, cell.options, who="designs")
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_target(cell: CellConfig) -> None:
    """A target (kvcert.targets) needs designs poisson or clt in every grid and, if calibrated, a fitted file of base
    paper; design clt needs a target."""
    designs = sorted({d for grid in cell.grids for d in grid.designs})
    floor_set = cell.target_floor not in (None, schema.HALF_CAP)  # the default floor does nothing without a target
    if cell.target_error is None and cell.target_delta is None and not floor_set:
        if "clt" in designs:
            raise ConfigError("designs=[..., clt]: design clt samples at decode time against a target: set "
                              "target_error (and target_delta)")
        return
    if cell.allocator != "uniform":
        raise ConfigError(f"allocator={cell.allocator}: a target chooses each KV head's sample size itself; drop "
                          "target_error or the allocator")
    try:
        for design in designs:
            check_target(design, cell.target_error, cell.target_delta, cell.target_floor)
        if cell.calibration is not None:
            calibrated_scales(cell.calibration, setting=cell.setting, policy="", budget=0.0, n_layers=0,
                              check_only=True)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    below = sorted({b for grid in cell.grids for b in grid.budgets if floor_set and b < cell.target_floor})
    if below:
        raise ConfigError(f"target_floor={cell.target_floor:g} exceeds budgets={below}: the budget is the target's "
                          "cap, and the floor must not exceed it")


def _default(f: dataclasses.Field) -> dict[str, Any]:
    """``{name: default}``: a key a config lacks (written before the key existed) has its default, or what its
    absence means where the default changed since (``absent_means``: target_floor, null)."""
    if "absent_means" in f.metadata:
        return {f.name: f.metadata["absent_means"]}
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return {f.name: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value}

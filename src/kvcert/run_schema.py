"""The run configuration's schema: every knob of a cell with its type, default, bounds and meaning, written once.

``RunConfig`` is the Hydra structured config of ``kvcert-run`` (``CalibrateConfig`` of ``kvcert-calibrate``):
kvcert.hydra_app registers both, so the YAML defaults, the command line's types and ``--help`` come from
here; kvcert.runner.config checks a config against the bounds and the names each field's metadata gives; a
cell's identity is the fields marked ``identity``; the calibration's design knobs are the fields marked
``design_knob``; the library's signatures take their defaults from ``RUN`` and ``DESIGN`` (e.g.
``RUN.delta``, ``RUN.observation_window``, ``DESIGN.n_sink``). Plain Python: imports nothing from kvcert,
needs no Hydra. See docs/GLOSSARY.md for what each knob means.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

MISSING = "???"  # OmegaConf's marker of a value the command line must give
# target_floor's default: every KV head keeps at least FLOOR_SHARE_OF_CAP of the cap (the budget), a uniform sample,
# the target choosing only what it adds (kvcert.targets).
HALF_CAP = "half_cap"
FLOOR_SHARE_OF_CAP = 0.5


def knob(default: Any, help: str, **check: Any) -> Any:  # noqa: A002 - the word the --help text is about
    """A field with its ``--help`` line and what the validation checks (``check``):

    low, high, low_open: numeric bounds (``lie_in``: say "must lie in (low, high]" instead of two lines);
    known: the field takes names of a registry (kvcert.runner.config.KNOWN holds them);
    identity: False for a knob that does not change what a cell computes;
    design_knob: the calibration factors depend on it (a calibration file records it);
    elided_at_default: a key added after committed cells: absent from a cell's config.yaml and identity while
    it holds its default (``elide_defaults``), so a cell that does not use it is written as before;
    absent_means: for such a key whose default changed after cells were committed without it, the value a config
    without the key ran with: the key is elided at that value instead of the default, and a config.yaml read back
    without it takes that value (kvcert.runner.config.validate);
    needs: for such a key, another key without which it does nothing: elided at its default while that one is null.
    """
    metadata = {"help": help, **check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DesignOptions:
    """``design_options``: the certainty head and the probability floor, the knobs the designs share
    (``kvcert.sampling.inclusion_probabilities``). The run schema's nested config and the library's immutable
    value at once (``kvcert.DesignOptions``): frozen, so that a default argument can be shared; Hydra composes
    it as an editable node (kvcert.hydra_app), so that the command line sets its keys."""

    n_sink: int = knob(4, "attention sinks: the first tokens, always kept (pi = 1)", low=0, design_knob=True)
    n_recent: int = knob(32, "recent window: the last prefix tokens, always kept (pi = 1)", low=1, design_knob=True)
    head_fraction: float = knob(0.5, "share of the budget beyond sinks + recent window kept with certainty by score",
                                low=0, high=1, lie_in=True, design_knob=True)
    pi_min: float = knob(1e-3, "floor of a sampled token's inclusion probability", low=0, high=1, low_open=True,
                         lie_in=True, design_knob=True)
    # The two defenses of the certificate (docs/GLOSSARY.md): added after committed cells, so elided from a cell's
    # config.yaml and identity while 0 (``elide_defaults``); design poisson only.
    tail_mix: float = knob(0.0, "defensive tail: share lambda of a uniform tail mixed into the scorer's tail pi at the "
                           "same expected count (every tail pi >= lambda * tail count / tail size); design poisson",
                           low=0, high=1, lie_in=True, design_knob=True, elided_at_default=True)
    head_attention_share: float = knob(0.0, "attention-aware certain head: share eta of the certain top slice given to "
                                       "the tokens the observation window's queries attend to most, the rest by "
                                       "score; design poisson", low=0, high=1, lie_in=True, design_knob=True,
                                       elided_at_default=True)


@dataclass
class GridKnobs:
    """One entry of ``extra_grids``: policy x design x budget x seed on the cell's prefill (seeds: the cell's)."""

    policies: list[str] = knob([], "scoring policies", known=True)
    designs: list[str] = knob([], "designs", known=True)
    budgets: list[float] = knob([], "retained fractions of the prefix", low=0, high=1, low_open=True)
    seeds: Optional[list[int]] = knob(None, "Poisson draws; null: the cell's seeds")


@dataclass
class RunConfig:
    """``kvcert-run``: one experimental cell (a model, a shard of a workload, a setting, every configuration).

    The field order is the order of the keys in a cell's config.yaml.
    """

    # Hydra's defaults list: the option of each config group (configs/run/data/, configs/run/model/) unless overridden.
    defaults: list[Any] = knob([{"data": "ruler"}, {"model": "smollm2"}, "_self_"], "config groups", identity=False)
    # The groups' keys are checked by their own loaders (kvcert.data, kvcert.models).
    data: dict[str, Any] = knob({}, "the workload: a file of configs/run/data/ (data=ruler|longbench|jsonl) and its keys")
    model: dict[str, Any] = knob({}, "the model: a file of configs/run/model/ (model=smollm2|gemma3|hf|gguf) and its keys")
    policies: list[str] = knob(["snapkv"], 'scoring policies (kvcert.POLICIES); "full" is always run as the reference',
                               known=True)
    designs: list[str] = knob(["topk", "poisson"], "topk (deterministic) | poisson (certain head + Poisson tail + "
                              "Hajek offset) | clt (the peers' decode-time CLT-sized sampler; keeps every slot; needs "
                              "target_error)", known=True)
    budgets: list[float] = knob([0.25, 0.5], "retained fraction of the prefix, each in (0, 1]", low=0, high=1,
                                low_open=True)
    seeds: list[int] = knob([0], "Poisson draws only; deterministic designs run once (seed 0)")
    # Entries stay untyped here (checked as GridKnobs): a typed entry would gain `seeds: null` in config.yaml.
    extra_grids: list[Any] = knob([], "more grids on the same prefill, e.g. [{policies: [uniform], designs: "
                                  "[poisson], budgets: [0.25]}]")
    setting: str = knob("question_aware", "question_aware | streaming", known=True)
    n_items: int = knob(20, "items of the workload before sharding", low=1)
    shard: int = knob(0, "this cell's shard index, 0 <= shard < n_shards", low=0)
    n_shards: int = knob(1, "shards of the workload", low=1)
    shard_by: str = knob("item", "item: every n_shards-th item | task: every n_shards-th item of each task (keeps "
                         "the mix of tasks)", known=True)
    oracle: bool = knob(True, "keep the full cache beside and measure the true error")
    certify: bool = knob(True, "compute certificates (serving mode: certify=true oracle=false)")
    store_steps: bool = knob(True, "write one steps.parquet row per step x layer x KV head (false: item summaries only)")
    decisions: bool = knob(True, "write decisions.parquet: per item and configuration, the decode and draw margins that "
                           "decided its answer (make verify-results reads them; false: not written)",
                           elided_at_default=True)
    calibration: Optional[str] = knob(None, 'a calibration file (kvcert-calibrate) or "design": adds cert_calibrated '
                                      "(+ coverage_calibrated)")
    check_calibration_prompts: bool = knob(True, "refuse a run whose prompts were calibrated on, or hold a task the "
                                           "file never saw", identity=False)
    delta: float = knob(0.05, "certificate level: sqrt(trV / delta) bounds the error w.p. >= 1 - delta (Chebyshev)",
                        low=0.0, high=0.999, low_open=True, design_knob=True)
    target_error: Optional[float] = knob(None, "target relative error of the attention output (design poisson; clt: "
                                         "its decode-time bound): per "
                                         "layer and KV head the smallest expected sample whose certificate, predicted "
                                         "on the observation window, meets it; budgets are caps. null: fixed budgets",
                                         elided_at_default=True)
    target_delta: Optional[float] = knob(None, "the target's delta in (0, 1); null: delta", elided_at_default=True)
    # Any, not Optional[float]: it also takes the word half_cap. Its default was null (no floor) until the
    # certified-budgets study's held-out checks (docs/studies/certified-budgets.md): a config.yaml without the key
    # ran without a floor.
    target_floor: Any = knob(HALF_CAP, "what every KV head keeps at least, the target choosing only what it adds "
                             "(design poisson): half_cap (half of each budget, the target's cap), a fraction of the "
                             "prefix in (0, 1] (at most every budget), or null: no floor", elided_at_default=True,
                             absent_means=None, needs="target_error")
    # Any, not Optional[dict]: OmegaConf cannot merge a mapping from the command line into a typed null.
    policy_options: Any = knob(None, "per policy, its dataclass options, e.g. {snapkv: {kernel_size: 7, pooling: max}}",
                               design_knob=True)
    observation_window: int = knob(16, "last prompt tokens whose queries score the cache (snapkv, tova)", low=1,
                                   design_knob=True)
    design_options: DesignOptions = knob(DesignOptions(), "the certainty head and the probability floor (docs/GLOSSARY.md)")
    allocator: str = knob("uniform", "slots per (layer, KV head): uniform | adakv (heads of a layer pool their budget) "
                          "| pyramidkv (layer-wise pyramid); kvcert.allocators", known=True, elided_at_default=True)
    # Any, as policy_options: the options depend on the allocator (checked by kvcert.runner.config).
    allocator_options: Any = knob(None, "the allocator's options, e.g. {alpha_safeguard: 0.2} (adakv), {beta: 20, "
                                  "window_size: null} (pyramidkv)", elided_at_default=True)
    max_context_tokens: Optional[int] = knob(None, "prompt limit in tokens; null: the model's max_position_embeddings",
                                             low=8)
    truncate: str = knob("middle", "middle: cut the middle of the context to fit | error: refuse", known=True)
    chat_template: bool = knob(False, "frame the prompt with the tokenizer's chat template, as kvpress does: the context "
                               "opens a user turn, the question closes it, the assistant's turn follows (streaming "
                               "compresses the framed context alone); a model without a template is refused",
                               elided_at_default=True)
    threads: Optional[int] = knob(None, "torch CPU threads; null: torch's default", low=1, identity=False)
    progress: bool = knob(True, "progress bar with ETA on stderr", identity=False)
    out_dir: str = knob(MISSING, "where items.parquet, steps.parquet, config.yaml, manifest.json go",
                                  identity=False)


@dataclass
class CalibrateConfig(RunConfig):
    """``kvcert-calibrate``: every kvcert-run key (the cell whose prompts it calibrates on) plus the fit's own."""

    out_dir: Optional[str] = knob(None, "keep the calibration cell's tables here (a rerun resumes it); null: a "
                                  "temporary folder, removed", identity=False)
    out: str = knob(MISSING, "the calibration file to write (JSON)", identity=False)
    level: Optional[float] = knob(None, "per-layer coverage the factors aim at; null: 1 - delta/5 "
                                  "(docs/CALIBRATION-LEVEL.md: why)", low=0.0, high=1.0, low_open=True)
    unit: str = knob("row", "what the conformal quantile treats as exchangeable: row | prompt (strict; needs >= "
                     "level/(1-level) prompts)", known=True)
    base: str = knob("paper", "the certificate the factor scales: paper (sqrt(trV/delta)) | design (its "
                     "design-based inflation)", known=True)
    relative_term: bool = knob(True, "per layer, add tau*||o_hat|| to the base where that narrows the certificate "
                               "(docs/METHOD.md §7)")
    never_below_paper: bool = knob(True, "the calibrated certificate is at least sqrt(trV/delta) on every row: it "
                                   "widens, never narrows")
    cells: Optional[list[str]] = knob(None, "fit from these oracle cell directories instead of running one")


RUN = RunConfig()
DESIGN = DesignOptions()
CALIBRATE_KEYS = tuple(f.name for f in dataclasses.fields(CalibrateConfig) if f.name not in RUN.__dataclass_fields__)
# Keys that change what a cell computes (a resumed cell must match them); the rest (out_dir, progress, threads) do not.
IDENTITY_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.metadata.get("identity", True))
KEYS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name != "defaults")
# The knobs that decide pi and the certificate, so a calibration's factors: design_options' (flattened), then the
# top-level ones by name (the order of a calibration file's "design").
DESIGN_KNOBS = (*(f.name for f in dataclasses.fields(DesignOptions) if f.metadata.get("design_knob")),
                *sorted(f.name for f in dataclasses.fields(RunConfig) if f.metadata.get("design_knob")))

# Keys a cell's config.yaml and identity leave out while they hold their default (see ``knob``).
ELIDED_AT_DEFAULT = tuple(f.name for f in dataclasses.fields(RunConfig) if f.metadata.get("elided_at_default"))
# What a config without one of those keys ran with: its default, or its ``absent_means`` where the default changed.
ABSENT_MEANS = {f.name: f.metadata.get("absent_means", getattr(RUN, f.name)) for f in dataclasses.fields(RunConfig)
                if f.name in ELIDED_AT_DEFAULT}
# design_options' keys elided likewise (the defenses: kvcert.sampling), each while it holds its default.
DESIGN_ELIDED_AT_DEFAULT = tuple(f.name for f in dataclasses.fields(DesignOptions) if f.metadata.get("elided_at_default"))
_NEEDS = {f.name: f.metadata["needs"] for f in dataclasses.fields(RunConfig) if f.metadata.get("needs")}


def elide_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a resolved run config, plain) without the ELIDED_AT_DEFAULT keys that hold what their absence
    means (ABSENT_MEANS), nor those at their default whose ``needs`` key is null (target_floor without a target)."""
    def elided(k, v):
        if k not in ELIDED_AT_DEFAULT:
            return False
        return v == ABSENT_MEANS[k] or (k in _NEEDS and config.get(_NEEDS[k]) is None and v == getattr(RUN, k))

    out = {k: v for k, v in config.items() if not elided(k, v)}
    nested = out.get("design_options")
    if isinstance(nested, dict) and any(k in nested for k in DESIGN_ELIDED_AT_DEFAULT):
        out["design_options"] = {k: v for k, v in nested.items()
                                 if not (k in DESIGN_ELIDED_AT_DEFAULT and v == getattr(DESIGN, k))}
    return out


# kvcert.estimator and kvcert.calibration.apply import these two names; the values are the schema's.
OBSERVATION_WINDOW = RUN.observation_window
DELTA = RUN.delta


def yaml_lines(schema: type = RunConfig, indent: str = "") -> list[str]:
    """The schema's defaults as commented YAML (what ``--help`` prints)."""
    lines = []
    for f in dataclasses.fields(schema):
        if f.name == "defaults":
            groups = ", ".join(f"{k}={v}" for entry in f.default_factory() if isinstance(entry, dict) for k, v in entry.items())
            lines.append(f"{indent}# config groups: {groups} unless overridden")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            lines.append(f"{indent}{f.name}:  # {f.metadata['help']}")
            lines.extend(yaml_lines(type(default), indent + "  "))
            continue
        lines.append(f"{indent}{f.name}: {_yaml(default)}  # {f.metadata['help']}")
    return lines


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


__all__ = [
    "ABSENT_MEANS", "CALIBRATE_KEYS", "DELTA", "DESIGN", "DESIGN_ELIDED_AT_DEFAULT", "DESIGN_KNOBS", "ELIDED_AT_DEFAULT", "FLOOR_SHARE_OF_CAP",
    "HALF_CAP", "IDENTITY_KEYS", "KEYS", "MISSING", "OBSERVATION_WINDOW", "RUN",
    "CalibrateConfig", "DesignOptions", "GridKnobs", "RunConfig", "elide_defaults", "knob", "yaml_lines",
]

"""The open registry of named analyses: what a pre-registration version's claims are computed by, by name.

A version names its base analysis (``analysis`` in preregistration/versions.yaml, or ``analysis_base`` in a
folder amendment's document; inherited by the versions that amend it) and may replace single claims by named
variants (its document's ``analysis`` mapping, e.g. amendment 4's ``c5_gating: within_model``; inherited too).
``analysis(version)`` returns the (claim registry, ``run_claim``) of that choice. Adding an amendment whose
analysis changes means registering one named function here (``register_variant``) and naming it in the
amendment's document; no claims module is copied and no code branches on a version number.

Bases: ``claims`` (version 1's frozen module) and ``amendment2`` (version 1's claims with C4 and C6 taking the
scikit-learn AUC method of kvcert.analysis.discrimination: amendment 2's analysis without its module's copies;
scikit-learn is imported only when asked for). Variants: every variant that a module of this package declares,
found by what the module declares (a top-level ``VARIANTS`` list or mapping, or ``register_variant`` decorators),
never by a module's name: today the frozen kvcert.analysis.variants (amendment 4's C5 within each model) and
kvcert.analysis.strata (C2/C3 per configuration, C6/C7 within each model), both read, never edited.

The same registry holds the methods that design an amendment's study (``register_method``): its pilot
(``pilot``), its power analysis (``power``), its cell plan (``plan``) and the rule that sizes the plan to a
budget (``design``). An amendment's data names each by name (``pilot.method``, ``power.method``,
``plan.method``, ``plan.design``); the workflow's scripts register the functions, and a new method is one
registered function.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from kvcert.analysis import claims
from kvcert.analysis.claims import ClaimDef, ClaimResult, Options, Tables
from kvcert.analysis.errors import AnalysisError

Analysis = tuple[dict[str, ClaimDef], Callable[..., ClaimResult]]

# name -> a loader of (claim registry, run_claim); loaders, so that a base's dependencies load only when used.
BASES: dict[str, Callable[[], Analysis]] = {}
# choice -> {name: the claim function}; a choice replaces the claim CLAIM_OF[choice].
VARIANTS: dict[str, dict[str, ClaimDef]] = {}
CLAIM_OF: dict[str, str] = {}


def register_base(name: str):
    """Decorator: register a loader of a base analysis under ``name``."""
    def add(loader: Callable[[], Analysis]) -> Callable[[], Analysis]:
        if name in BASES:
            raise ValueError(f"analysis base {name!r} is registered twice")
        BASES[name] = loader
        return loader
    return add


def register_variant(choice: str, claim: str, name: str, tables: tuple[str, ...] = ("items",)):
    """Decorator: register ``fn(tables, spec, conventions, opts) -> ClaimResult`` as variant ``name`` of ``choice``,
    which replaces claim ``claim`` (a choice always replaces the same claim)."""
    def add(fn):
        _add_variant(choice, claim, name, ClaimDef(fn, tables))
        return fn
    return add


def _add_variant(choice: str, claim: str, name: str, definition: ClaimDef) -> None:
    if CLAIM_OF.setdefault(choice, claim) != claim:
        raise ValueError(f"analysis choice {choice!r} replaces {CLAIM_OF[choice]}, not {claim}")
    if name in VARIANTS.setdefault(choice, {}):
        raise ValueError(f"analysis variant {choice}={name} is registered twice")
    VARIANTS[choice][name] = definition


@register_base("claims")
def _claims() -> Analysis:
    return claims.REGISTRY, claims.run_claim


@register_base("amendment2")
def _amendment2() -> Analysis:
    """Amendment 2's analysis, live: version 1's claims with C4 and C6 computing their AUCs by scikit-learn
    (kvcert.analysis.discrimination). The frozen module amendment2.py stays as it was locked;
    tests/test_discrimination.py shows this gives its claim JSONs."""
    from kvcert.analysis import discrimination

    registry = {**claims.REGISTRY,
                "c4": ClaimDef(discrimination.prediction("sklearn"), ("items",)),
                "c6": ClaimDef(discrimination.attribution("sklearn"), ("items",))}
    return registry, runner(registry)


def runner(registry: dict[str, ClaimDef]) -> Callable[..., ClaimResult]:
    """``run_claim`` over ``registry``: the claim's function, then the run's options recorded in ``details.run``
    (as claims.run_claim records them)."""
    def run_claim(claim_id: str, tables: Tables, spec: dict, conventions: dict, opts: Options) -> ClaimResult:
        if claim_id not in registry:
            raise AnalysisError(f"claim={claim_id!r} is not one of {sorted(registry)}")
        result = registry[claim_id].fn(tables, spec, conventions, opts)
        _record_run(result, spec, conventions, opts)
        return result
    return run_claim


def _record_run(result: ClaimResult, spec: dict, conventions: dict, opts: Options) -> None:
    prereg_boot = int(spec.get("test", {}).get("n_boot", conventions.get("n_boot", 2000)))
    result.details["run"] = {
        "scale": opts.scale, "n_boot": opts.n_boot, "seed": opts.seed, "alpha": opts.alpha,
        "n_boot_below_preregistered": opts.n_boot < prereg_boot,
    }


def _frozen_variants() -> None:
    """The variants of the frozen module kvcert.analysis.variants, registered under their own names."""
    from kvcert.analysis import variants

    for choice, named in variants.VARIANTS.items():
        for name, definition in named.items():
            _add_variant(choice, variants.CLAIM_OF[choice], name, definition)


_frozen_variants()



# A module declares variants by a top-level VARIANTS (strata's list of (choice, claim, name, tables, fn)) or by
# this module's register_variant decorator; variants.py's mapping is registered above.
_DECLARES = re.compile(r"^(VARIANTS\b|@(registry\.)?register_variant\()", re.M)


def _declared_variants() -> None:
    """Register the variants of every module of this package that declares some, found by its source text (so
    that no module is imported by name and none is imported that declares nothing), in file-name order."""
    import importlib

    package = Path(__file__).resolve().parent
    for path in sorted(package.glob("*.py")):
        if path.stem in ("__init__", "registry", "variants") or not _DECLARES.search(path.read_text()):
            continue
        module = importlib.import_module(f"{__package__}.{path.stem}")
        listed = getattr(module, "VARIANTS", None)
        if isinstance(listed, list):
            for choice, claim, name, tables, fn in listed:
                if name not in VARIANTS.get(choice, {}):
                    _add_variant(choice, claim, name, ClaimDef(fn, tables))


_declared_variants()


def with_choices(base: Analysis, choices: dict[str, str], where: str) -> Analysis:
    """(registry, run_claim) of ``base`` with the claims named by ``choices`` ({choice: variant name}) replaced.

    A replaced claim's result records the run's options (``details.run``) and the choice it ran
    (``details.analysis_variant``), as kvcert.analysis.variants records them; every other claim is the base's.
    ``where`` (the document the choices come from) is named in errors.
    """
    registry, run_claim = base
    if not choices:
        return registry, run_claim
    replaced: dict[str, ClaimDef] = {}
    for choice, name in choices.items():
        if choice not in VARIANTS:
            raise AnalysisError(f"{where}: analysis.{choice}: unknown; known: {', '.join(sorted(VARIANTS))}")
        if name not in VARIANTS[choice]:
            raise AnalysisError(f"{where}: analysis.{choice}={name!r}: unknown; known: "
                                f"{', '.join(sorted(VARIANTS[choice]))}")
        replaced[CLAIM_OF[choice]] = VARIANTS[choice][name]
    chosen = {CLAIM_OF[c]: {c: n} for c, n in choices.items()}

    def run(claim_id: str, tables: Tables, spec: dict, conventions: dict, opts: Options) -> ClaimResult:
        if claim_id not in replaced:
            return run_claim(claim_id, tables, spec, conventions, opts)
        result = replaced[claim_id].fn(tables, spec, conventions, opts)
        _record_run(result, spec, conventions, opts)
        result.details["analysis_variant"] = chosen[claim_id]
        return result

    return {**registry, **replaced}, run


def analysis(version) -> Analysis:
    """(registry, run_claim) of a pre-registration version (kvcert.analysis.prereg.Version): its base analysis
    with its analysis choices applied."""
    if version.analysis not in BASES:
        raise AnalysisError(f"{version.document}: analysis base {version.analysis!r}: unknown; known: "
                            f"{', '.join(sorted(BASES))}")
    registry, run_claim = with_choices(BASES[version.analysis](), dict(version.choices), version.document)
    return registry, on_default_configuration(registry, run_claim)


# Configuration columns a later design factor adds to the items and steps tables (beyond strata's allocator and
# head_fraction), each with the value a row without the column ran at: {column: default}. A module that adds a
# factor registers its column (``register_configuration_column``); the claims not decided per configuration then
# read the rows at its default only. Registered: the certificate's two defenses (design_options.tail_mix and
# head_attention_share, default 0; amendment 6's factors, split per configuration by kvcert.analysis.defended). No
# committed table has either column, so every committed table is read as before.
CONFIGURATION_COLUMNS: dict[str, float] = {}


def register_configuration_column(column: str, default: float) -> None:
    if CONFIGURATION_COLUMNS.setdefault(column, default) != default:
        raise ValueError(f"configuration column {column!r} is registered with default {CONFIGURATION_COLUMNS[column]}")


register_configuration_column("tail_mix", 0.0)
register_configuration_column("head_attention_share", 0.0)


def _at_defaults(tables: Tables) -> Tables:
    """``tables`` restricted to the rows at every registered configuration column's default (a missing column or
    value is the default)."""
    import numpy as np

    def rows(df):
        if df is None or not CONFIGURATION_COLUMNS:
            return df
        keep = np.ones(len(df), dtype=bool)
        for column, default in CONFIGURATION_COLUMNS.items():
            if column in df.columns:
                keep &= np.isclose(df[column].astype(float).fillna(default).to_numpy(), default)
        return df if keep.all() else df[keep]
    return Tables(items=rows(tables.items), steps=rows(tables.steps))


def on_default_configuration(registry: dict[str, ClaimDef], run_claim: Callable[..., ClaimResult]):
    """``run_claim`` with every claim that does not decide per configuration reading the default configuration's
    rows only (kvcert.analysis.strata.default_configuration: the identity on tables without allocator and
    head_fraction columns, which is every table of versions 1-4; then every registered configuration column at
    its default)."""
    from kvcert.analysis import strata

    def run(claim_id: str, tables: Tables, spec: dict, conventions: dict, opts: Options) -> ClaimResult:
        definition = registry.get(claim_id)
        if definition is not None and not strata.reads_configurations(definition.fn):
            tables = _at_defaults(strata.default_configuration(tables))
        return run_claim(claim_id, tables, spec, conventions, opts)
    return run


# --- the methods that design an amendment's study, by name ------------------------------------------------------

# kind -> {name: function}. pilot: how the population is obtained (pilot.method); power: the power analysis
# (power.method); plan: the cells of a design from a population, item counts and data seeds (plan.method);
# design: the rule that sizes a plan's cells to the amendment's budget from the measured times (plan.design).
METHOD_KINDS = ("pilot", "power", "plan", "design")
METHODS: dict[str, dict[str, Callable]] = {kind: {} for kind in METHOD_KINDS}


def register_method(kind: str, name: str, **attributes):
    """Decorator: register ``fn`` as method ``name`` of ``kind`` (one of METHOD_KINDS); ``attributes`` are set on
    the function (e.g. a pilot's ``steps``: how the workflow obtains its population). A script loaded twice (as a
    module under two names) registers the same function again, which replaces it; another function under a
    registered name is an error."""
    if kind not in METHODS:
        raise ValueError(f"method kind {kind!r}: unknown; known: {', '.join(METHOD_KINDS)}")

    def add(fn: Callable) -> Callable:
        for key, value in attributes.items():
            setattr(fn, key, value)
        known = METHODS[kind].get(name)
        if known is not None and _source(known) != _source(fn):
            raise ValueError(f"{kind} method {name!r} is registered twice ({known.__qualname__}, {fn.__qualname__})")
        METHODS[kind][name] = fn
        return fn
    return add


def _source(fn: Callable) -> tuple[str, str]:
    code = getattr(fn, "__code__", None)
    return (code.co_filename if code else repr(fn), fn.__qualname__)


def method(kind: str, name, where: str) -> Callable:
    """The function registered as ``name`` of ``kind``; ``where`` (the document and key that name it) is named in
    the one-line error for an unknown name."""
    if kind not in METHODS:
        raise AnalysisError(f"{where}: method kind {kind!r}: unknown; known: {', '.join(METHOD_KINDS)}")
    if name not in METHODS[kind]:
        raise AnalysisError(f"{where}={name!r}: no {kind} method of that name; known: "
                            f"{', '.join(sorted(METHODS[kind])) or 'none'}")
    return METHODS[kind][name]


def methods(kind: str) -> dict[str, Callable]:
    """{name: function} of every registered method of ``kind``."""
    return dict(METHODS[kind])

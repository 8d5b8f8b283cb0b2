"""C2 and C3 per configuration with the certificate's defenses as factors: amendment 5's variants (kvcert.analysis.
strata, frozen, read and never edited) over a configuration that also names its defenses.

A run with a defense records it in the items and steps tables (columns ``tail_mix``, lambda, and
``head_attention_share``, eta; kvcert.table_columns.DEFENSE_COLUMNS; a table or row without one ran at 0).
kvcert.analysis.registry registers both as configuration columns (default 0), so every claim that is not decided per
configuration reads the undefended rows only. Here the scorer's name carries its non-zero defenses (``cur+lambda0.2``,
``cur+eta0.5``, ``cur+lambda0.2+eta0.5``; ``cur`` alone without a defense), and strata's variants then decide one
component per (scorer and defenses, allocator, share) (C3: coverage and Spearman, budgets pooled; C2: per budget),
items bootstrapped jointly, as amendment 5 decided them:

    analysis:
      c2_scope: per_configuration_and_defenses
      c3_scope: per_configuration_and_defenses

Top-k has no sampled tail and refuses the defenses, so C2's reference of a defended Poisson configuration is top-k of
its scorer, allocator and budget (the same rows as the undefended one's). Beside C2's components, not tested,
``details.defended_minus_undefended``: per defended configuration and budget, Poisson with the defense minus Poisson
without it at the same scorer, allocator, share and budget (points, paired per item, its bootstrap interval): what
the defense costs or gains in accuracy. Tables without defense columns are analysed exactly as strata's variants
analyse them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvcert.analysis import data, parts, strata
from kvcert.analysis.claims import ClaimResult, Options, Tables, population
from kvcert.analysis.stats import weighted_mean

# column -> the label a scorer's name carries for it (the design's symbols for the two defenses)
DEFENSES = {"tail_mix": "lambda", "head_attention_share": "eta"}
MARK = "+"

# (choice, claim, name, tables, function): kvcert.analysis.registry registers them (as it registers strata's).
VARIANTS: list[tuple[str, str, str, tuple[str, ...], object]] = []


def _variant(choice: str, claim: str, name: str, tables: tuple[str, ...]):
    def add(fn):
        fn.reads_configurations = True  # decides per configuration: reads every row (strata.reads_configurations)
        VARIANTS.append((choice, claim, name, tables, fn))
        return fn
    return add


def labelled(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """``df`` with each row's non-zero defenses appended to its policy (``cur+lambda0.2+eta0.5``) and the defense
    columns dropped; a table without them is returned as it is."""
    if df is None or not any(c in df.columns for c in DEFENSES):
        return df
    out = df.copy()
    suffix = pd.Series("", index=out.index)
    for column, label in DEFENSES.items():
        if column in out.columns:
            value = out[column].astype(float).fillna(0.0)
            suffix = suffix + value.map(lambda v, label=label: f"{MARK}{label}{v:g}" if v != 0 else "")
    out["policy"] = out["policy"].astype(str) + suffix
    return out.drop(columns=[c for c in DEFENSES if c in out.columns])


def base_policy(label: str) -> str:
    return label.split(MARK, 1)[0]


@_variant("c3_scope", "c3", "per_configuration_and_defenses", ("steps",))
def coverage_per_defense(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C3 per (scorer and its defenses, allocator, share): strata's per-configuration C3 over the labelled steps."""
    return strata.coverage_per_configuration(Tables(items=tables.items, steps=labelled(tables.steps)), spec, conv, opts)


@_variant("c2_scope", "c2", "per_configuration_and_defenses", ("items",))
def no_cost_per_defense(tables: Tables, spec: dict, conv: dict, opts: Options) -> ClaimResult:
    """C2 per (scorer and its defenses, allocator, share, budget) against top-k of the scorer (strata's
    per-configuration C2 over the labelled items, each defended label given its scorer's top-k rows), with
    ``details.defended_minus_undefended`` beside it."""
    items = labelled(tables.items)
    defended = sorted({p for p in items["policy"].astype(str).unique() if MARK in p})
    topk = items[items["design"] == "topk"]
    copies = [topk[topk["policy"] == base_policy(label)].assign(policy=label) for label in defended]
    result = strata.no_cost_per_configuration(Tables(items=pd.concat([items, *copies], ignore_index=True)
                                                     if copies else items, steps=tables.steps), spec, conv, opts)
    if defended:
        result.details["defended_minus_undefended"] = _defended_minus_undefended(items, defended, spec, opts)
    return result


def _defended_minus_undefended(items: pd.DataFrame, defended: list[str], spec: dict, opts: Options) -> dict:
    """{"<label>,<allocator>,<share>,<budget>": {estimate, ci_low, ci_high, n}}: Poisson with the defenses minus
    Poisson without them (points), paired per item, items bootstrapped jointly over every entry."""
    pop = population(spec, opts.scale)
    rows = items[(items["setting"] == pop["setting"]) & (items["design"] == "poisson")]
    rows = strata.with_configuration(rows[rows["policy"].isin([*defended, *map(base_policy, defended)])])
    columns, names = {}, []
    for label in defended:
        mine = rows[rows["policy"] == label]
        for a, h, b in sorted({(a, float(h), float(b)) for a, h, b in
                               mine[[strata.ALLOCATOR, strata.SHARE, "budget"]].itertuples(index=False)}):
            if not any(np.isclose(b, float(x)) for x in pop["budgets"]):
                continue
            def same(df, a=a, h=h, b=b):
                return df[(df[strata.ALLOCATOR] == a) & np.isclose(df[strata.SHARE], h) & data.budget_mask(df, b)]
            without = same(rows[rows["policy"] == base_policy(label)])
            if without.empty:
                continue
            name = f"{label},{a},{h:g},{b:g}"
            columns[(name, "with")] = data.per_unit_mean(same(mine), "correct")
            columns[(name, "without")] = data.per_unit_mean(without, "correct")
            names.append(name)
    if not names:
        return {}
    complete = pd.concat({f"{k[0]}|{k[1]}": v for k, v in columns.items()}, axis=1).dropna()
    if complete.empty:
        return {}
    D = 100 * np.column_stack([complete[f"{n}|with"].to_numpy() - complete[f"{n}|without"].to_numpy() for n in names])
    ivs = parts.bootstrap(lambda W: weighted_mean(D, W), len(complete), opts)
    return {n: {"estimate": float(iv.estimate), "ci_low": float(iv.low), "ci_high": float(iv.high),
                "n": int(len(complete))} for n, iv in zip(names, ivs)}

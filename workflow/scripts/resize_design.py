"""Resize a study's design to a cell-time budget, from the times its own cells measured (amendment 3's rule).

    python workflow/scripts/resize_design.py --cells results/v2/cells --budget-minutes 65 --cores 2 \
        --keep oracle --out preregistration/amendment-3/design.yaml

The cost of one item of a cell is the median, over the cell's shards, of the shard's wall seconds
(manifest.json ``wall_seconds.total``) divided by its items: the median, because a shard that shared the
machine with other work reads slower than the design will run. Cells named by ``--keep`` (a prefix, e.g. the
oracle cells) keep their item count and cost their measured total. Every other cell's count is scaled by one
common factor f, the largest for which the estimated cell time fits the budget with ``--cores`` cells at a
time, and rounded down. Reads times only: no item table, answer or verdict.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
from pathlib import Path

import yaml

from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.registry import method, register_method
from kvcert.atomic import write_text_atomic


def measured(cells: Path) -> dict[str, dict]:
    """{cell: {"items": n, "seconds": total, "shards": k, "per_item_median": s}} from the shards' manifests."""
    out: dict[str, dict] = {}
    for manifest in sorted(cells.glob("*/shard-*/manifest.json")):
        m = json.loads(manifest.read_text())
        cell = manifest.parent.parent.name
        entry = out.setdefault(cell, {"items": 0, "seconds": 0.0, "shards": 0, "per_shard": []})
        n, seconds = int(m["n_shard_items"]), float(m["wall_seconds"]["total"])
        entry["items"] += n
        entry["seconds"] += seconds
        entry["shards"] += 1
        entry["per_shard"].append(seconds / n)
    if not out:
        raise SystemExit(f"{cells}: no */shard-*/manifest.json")
    for entry in out.values():
        entry["per_item_median"] = statistics.median(entry.pop("per_shard"))
    return out


def resize(cells: dict[str, dict], budget_seconds: float, keep: tuple[str, ...]) -> dict:
    kept = {c: e for c, e in cells.items() if c.startswith(keep)}
    scaled = {c: e for c, e in cells.items() if c not in kept}
    fixed = sum(e["seconds"] for e in kept.values())
    variable = sum(e["items"] * e["per_item_median"] for e in scaled.values())
    factor = (budget_seconds - fixed) / variable
    if factor <= 0:
        raise SystemExit(f"the kept cells alone ({fixed:.0f} cell-seconds) exceed the budget ({budget_seconds:.0f})")
    factor = min(1.0, factor)
    counts = {c: e["items"] for c, e in kept.items()}
    counts.update({c: math.floor(e["items"] * factor) for c, e in scaled.items()})
    estimate = fixed + sum(counts[c] * e["per_item_median"] for c, e in scaled.items())
    return {"factor": round(factor, 4), "counts": dict(sorted(counts.items())),
            "estimated_cell_seconds": round(estimate), "budget_cell_seconds": round(budget_seconds)}


# --- an amendment's design from its data: the cell plan and the rule that sizes it, by name ---------------------------
#
# An amendment's data (its document, or for a locked document that states them in words only, its sidecar: pilot.py's
# amendment_data) names a cell plan (``plan.method``) and a design rule (``plan.design``), and gives the plan's
# factors (``plan.scorers``, ``plan.allocators``, ``plan.factors``, ``plan.budgets``, ...). Both are registered
# functions (kvcert.analysis.registry, kinds "plan" and "design"): a new plan or rule is one registered function, and a
# new study of an existing plan is data only.

KINDS = ("qa", "oracle", "streaming")
PLAN_KEYS = ("method", "design", "items_per_shard", "scorers", "budgets", "poisson_seeds", "streaming")


def _flow(value) -> str:
    """A Hydra override value in flow style without spaces: {name:vt,num_hops:1}."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_flow(v) for v in value) + "]"
    return str(value)


def _g(value) -> str:
    """A factor value as a cell name and an override write it: 0.8, 0.95, 1."""
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def plan_of(doc: dict, where: str) -> dict:
    """The amendment's ``plan`` mapping, checked: its method and design rule registered, its keys present."""
    plan = doc.get("plan")
    if not isinstance(plan, dict):
        raise SystemExit(f"{where}: plan: missing; an amendment names its cell plan (plan.method), its design rule "
                         "(plan.design) and its factors")
    missing = [k for k in PLAN_KEYS if k not in plan]
    if missing:
        raise SystemExit(f"{where}: plan lacks {', '.join(missing)}")
    try:
        method("plan", plan["method"], f"{where}: plan.method")
        method("design", plan["design"], f"{where}: plan.design")
    except AnalysisError as error:  # one line: the file, the key, the name and the registered ones
        raise SystemExit(str(error)) from None
    if not isinstance(plan["scorers"], (dict, list)) or not plan["scorers"]:
        raise SystemExit(f"{where}: plan.scorers={plan['scorers']!r}: expected scorer names (or scorer: press)")
    return plan


def _pooling(scorer: str) -> bool:
    """Whether a scorer pools its scores with a kernel (a ``kernel_size`` option): the population's K applies."""
    import dataclasses as dc

    from kvcert.policies import POLICIES

    if scorer not in POLICIES:
        raise SystemExit(f"plan.scorers: {scorer!r} is not a registered policy; known: {', '.join(sorted(POLICIES))}")
    return "kernel_size" in {f.name for f in dc.fields(POLICIES[scorer])}


def _pooled(scorers, kernel) -> dict:
    return {s: {"kernel_size": kernel} for s in scorers if _pooling(s)}


def _shards(spec: dict, n: int) -> int:
    return max(1, math.ceil(n / int(spec["items_per_shard"])))


@register_method("plan", "cell_per_kind")
def planned_cells(population: dict, counts: dict[str, int], seeds: dict[str, int], spec: dict) -> dict[str, dict]:
    """Scale-file cells (name -> {model, shards, overrides}), one per (kind, model): the plan's scorers, Poisson
    seeds and budgets at the model's tasks, SnapKV window and kernel; the oracle cells add ``oracle_extra_grids``.

    counts: items per cell name (e.g. "qa-smollm2"); seeds: data seeds {"qa": .., "oracle": .., "streaming": ..}.
    """
    scorers = list(spec["scorers"])
    out = {}
    for model, chosen in population["models"].items():
        knobs = [f"observation_window={chosen['window']}", f"policy_options={_flow(_pooled(scorers, chosen['kernel']))}",
                 f"policies={_flow(scorers)}", f"seeds={_flow(list(spec['poisson_seeds']))}"]
        for kind in KINDS:
            name = f"{kind}-{model}"
            tasks = chosen["streaming"] if kind == "streaming" else chosen["question_aware"]
            grid = (["setting=streaming", "designs=[poisson]", f"budgets={_flow(list(spec['streaming']['budgets']))}",
                     "oracle=false", "store_steps=false"]
                    if kind == "streaming" else
                    ["setting=question_aware", "designs=[topk,poisson]", f"budgets={_flow(list(spec['budgets']))}"]
                    + ([f"extra_grids={_flow(list(spec.get('oracle_extra_grids') or []))}", "oracle=true"]
                       if kind == "oracle" else ["oracle=false", "store_steps=false"]))
            out[name] = {"model": model, "shards": _shards(spec, counts[name]),
                         "overrides": ["data=ruler", f"data.tasks={_flow(tasks)}", f"data.seed={seeds[kind]}",
                                       *knobs, f"n_items={counts[name]}", *grid]}
    return out


def allocators_of(spec: dict) -> dict[str, tuple[str, ...]]:
    """{allocator: the scorers it runs over}; ``scorers`` (the word) stands for every scorer of the plan."""
    scorers = tuple(spec["scorers"])
    found = spec.get("allocators") or {_default("allocator"): "scorers"}
    return {a: scorers if over == "scorers" else tuple(over) for a, over in found.items()}


def _default(key: str):
    """The run schema's default of an override key (``allocator``, ``design_options.<name>``): a cell at it omits the
    override, as the committed cells were run."""
    import dataclasses as dc

    from kvcert.run_schema import DesignOptions, RunConfig

    owner, name = (DesignOptions, key.split(".", 1)[1]) if key.startswith("design_options.") else (RunConfig, key)
    for field in dc.fields(owner):
        if field.name == name:
            return field.default
    raise SystemExit(f"plan.factors: override {key}: not a key of the run configuration")


def factors_of(spec: dict, population: dict) -> list[dict]:
    """The plan's cell factors, each {override, label, values, default, alone}; a value "population:<key>" is read
    from the population (a pilot rule's choice, e.g. population:chosen.tail_mix); ``default`` is the run schema's.
    The factors cross (one cell per combination of values), except that of the factors marked ``alone: true`` at
    most one leaves its default in a cell (e.g. two defenses, each with and without, never both at once)."""
    out = []
    for i, factor in enumerate(spec.get("factors") or []):
        where = f"plan.factors[{i}]"
        if not isinstance(factor, dict) or not {"override", "label", "values"} <= set(factor):
            raise SystemExit(f"{where}={factor!r}: expected {{override, label, values}}")
        default = _default(str(factor["override"]))
        if "default" in factor and factor["default"] != default:
            raise SystemExit(f"{where}.default={factor['default']!r}: the run schema's default of "
                             f"{factor['override']} is {default!r}")
        values = []
        for value in factor["values"]:
            if isinstance(value, str) and value.startswith("population:"):
                found = population
                for part in value.removeprefix("population:").split("."):
                    if not isinstance(found, dict) or part not in found:
                        raise SystemExit(f"{where}.values: {value}: not in the population")
                    found = found[part]
                value = found
            values.append(value)
        out.append({"override": str(factor["override"]), "label": str(factor["label"]), "values": values,
                    "default": default, "alone": bool(factor.get("alone", False))})
    return out


@register_method("plan", "cell_per_configuration")
def configuration_cells(population: dict, counts: dict[str, int], seeds: dict[str, int], spec: dict) -> dict[str, dict]:
    """Scale-file cells of a design per configuration. Per model: the question-aware and oracle cell types, each one
    cell per (allocator, values of the plan's factors) because a cell runs one allocator and one value of each
    factor (e.g. design_options.head_fraction); and the streaming cell, the plan's ``streaming`` scorer and budgets.
    Top-k runs only in the cell where every factor is at its default (it has no sampled tail): the reference of
    Poisson at every value. The oracle cells run Poisson only (C3). Every cell of a type has the same items (data
    seed and count), so the configurations pair per item across cells.

    A cell is named <kind>-<model>, then -<allocator> unless the default, then -<label><value> per factor not at
    its default (e.g. qa-smollm2-adakv-share0.8). The analysis tells configurations apart by the tables' columns
    (allocator, head_fraction, ...), a missing one read as the default. The timing cells read times only.
    counts: items per cell *type* ("qa-smollm2", "oracle-smollm2", "streaming-smollm2"); seeds: data seeds by kind.
    """
    allocators = allocators_of(spec)
    factors = factors_of(spec, population)
    default_allocator = _default("allocator")
    seed_list = _flow(list(spec["poisson_seeds"]))
    budgets = _flow(list(spec["budgets"]))
    out = {}
    for model, chosen in population["models"].items():
        window, kernel = chosen["window"], chosen["kernel"]
        for kind in ("qa", "oracle"):
            data = ["data=ruler", f"data.tasks={_flow(chosen['question_aware'])}", f"data.seed={seeds[kind]}",
                    f"n_items={counts[f'{kind}-{model}']}"]
            for allocator, over in allocators.items():
                for values in itertools.product(*(f["values"] for f in factors)):
                    off = [(f, v) for f, v in zip(factors, values) if v != f["default"]]
                    if sum(f["alone"] for f, _ in off) > 1:  # factors marked alone leave their default one at a time
                        continue
                    designs = ["poisson"] if kind == "oracle" or off else ["topk", "poisson"]
                    pooled = _pooled(over, kernel)
                    name = (f"{kind}-{model}" + (f"-{allocator}" if allocator != default_allocator else "")
                            + "".join(f"-{f['label']}{_g(v)}" for f, v in off))
                    out[name] = {"model": model, "kind": kind, "shards": _shards(spec, counts[f"{kind}-{model}"]),
                                 "overrides": [
                                     *data, f"observation_window={window}",
                                     *([f"policy_options={_flow(pooled)}"] if pooled else []),
                                     f"policies={_flow(list(over))}", f"seeds={seed_list}",
                                     *([f"allocator={allocator}"] if allocator != default_allocator else []),
                                     *(f"{f['override']}={_g(v)}" for f, v in off),
                                     "setting=question_aware", f"designs={_flow(designs)}", f"budgets={budgets}",
                                     *(["oracle=true"] if kind == "oracle" else ["oracle=false", "store_steps=false"])]}
        n = counts[f"streaming-{model}"]
        scorer = spec["streaming"]["scorer"]
        pooled = _pooled([scorer], kernel)
        out[f"streaming-{model}"] = {
            "model": model, "kind": "streaming", "shards": _shards(spec, n),
            "overrides": ["data=ruler", f"data.tasks={_flow(chosen['streaming'])}", f"data.seed={seeds['streaming']}",
                          f"n_items={n}", f"observation_window={window}",
                          *([f"policy_options={_flow(pooled)}"] if pooled else []), f"policies=[{scorer}]",
                          f"seeds={seed_list}", "setting=streaming", "designs=[poisson]",
                          f"budgets={_flow(list(spec['streaming']['budgets']))}", "oracle=false", "store_steps=false"]}
    return out


def smoke_spec(spec: dict) -> dict:
    """The plan on almost nothing, to prove every cell kind runs (its times size nothing): two scorers, the first two
    allocators over those scorers (or their own first), each factor's first and last value, one Poisson seed."""
    scorers = list(spec["scorers"])[:2]
    allocators = {}
    for allocator, over in list(allocators_of(spec).items())[:2]:
        allocators[allocator] = [s for s in over if s in scorers] or list(over[:1])
    factors = [{**f, "values": list(dict.fromkeys([f["values"][0], f["values"][-1]]))} for f in spec.get("factors") or []]
    return {**spec, "scorers": scorers, "allocators": allocators, "factors": factors,
            "poisson_seeds": list(spec["poisson_seeds"])[:1]}


def cell_type(name: str) -> str:
    """The cell type of a configuration cell's name: "qa-smollm2-adakv-share0.8" -> "qa-smollm2"."""
    return "-".join(name.split("-")[:2])


def time_cells(population: dict, out_dir: Path, n_items: int, seed: int, cores: int, plan, run_cells) -> Path:
    """Run every cell of ``plan`` (a function of population, counts and seeds) on ``n_items`` pilot items (data seed
    ``seed``), ``cores`` cells at a time with one thread each, as `make reproduce` runs them; returns ``out_dir`` (one
    shard-0 per cell, read by ``measured``). Only the manifests' wall seconds are read; the answers are not.
    run_cells: the pilot's runner (pilot.py's run_cells), so timing and pilot cells run alike."""
    import shutil

    counts = {f"{kind}-{model}": n_items for model in population["models"] for kind in KINDS}
    cells = plan(population, counts, {kind: seed for kind in KINDS})
    run_cells(cells, out_dir, cores, what="timing")
    for leftover in out_dir.glob("*/shard-0/.parts"):
        shutil.rmtree(leftover, ignore_errors=True)
    return out_dir


def design(population: dict, power: dict, timing: dict[str, dict], budget_seconds: float, seeds: dict[str, int],
           c6_min_items: int, *, prereg: int, oracle_items: dict[str, int], spec: dict, plan=planned_cells) -> dict:
    """The powered design and, when it does not fit the budget, the scaled one (``resize``'s rule); each
    streaming cell keeps at least ``c6_min_items`` / number of models items (C6's failing runs per class) if that
    leaves the question-aware cells ``spec["min_qa_items"]`` pooled; ``prereg``: the version the studies apply (the
    amendment document's ``version``); ``oracle_items``: {model: items} of the oracle cells, kept."""
    models = list(population["models"])
    per_model = power["per_model"]
    cells_of = functools.partial(plan, spec=spec)
    full = {}
    for model in models:
        if model not in oracle_items:
            raise SystemExit(f"power.oracle_items: no count for model {model}")
        full[f"qa-{model}"] = per_model["question_aware"]
        full[f"streaming-{model}"] = per_model["streaming"]
        full[f"oracle-{model}"] = int(oracle_items[model])
    cost = {c: timing[c]["per_item_median"] for c in full}
    cells = {c: {"items": n, "seconds": n * cost[c], "per_item_median": cost[c]} for c, n in full.items()}
    scaled = resize(cells, budget_seconds, keep=("oracle",))
    scaled["c6_floor_kept"] = False
    floor = math.ceil(c6_min_items / len(models))
    if any(scaled["counts"][f"streaming-{m}"] < min(floor, full[f"streaming-{m}"]) for m in models):
        # The streaming cells keep C6's minimum and the question-aware cells take what is left, if that leaves
        # them min_qa_items; otherwise the uniform scaling stands and only the powered study meets C6's count.
        floored = dict(cells)
        for m in models:
            n = min(floor, full[f"streaming-{m}"])
            floored[f"streaming-{m}"] = {"items": n, "seconds": n * cost[f"streaming-{m}"],
                                         "per_item_median": cost[f"streaming-{m}"]}
        fixed = sum(e["seconds"] for c, e in floored.items() if c.startswith(("oracle", "streaming")))
        if fixed < budget_seconds:
            attempt = resize(floored, budget_seconds, keep=("oracle", "streaming"))
            if sum(n for c, n in attempt["counts"].items() if c.startswith("qa")) >= int(spec["min_qa_items"]):
                scaled = {**attempt, "c6_floor_kept": True}
    out = {"powered": {"counts": full, "estimated_cell_seconds": round(sum(full[c] * cost[c] for c in full)),
                       "study": {"prereg": prereg, "cells": cells_of(population, full, seeds)}},
           "reproduce_90_minutes": {**scaled, "study": {"prereg": prereg, "cells": cells_of(population, scaled["counts"], seeds)}}}
    out["fits"] = scaled["factor"] >= 1.0 and all(scaled["counts"][c] >= full[c] for c in full)
    return out


@register_method("design", "c6_floor_then_scale")
def c6_floor_then_scale(doc: dict, spec: dict, population: dict, power: dict, timing: dict, budget_seconds: float,
                        seeds: dict[str, int], plan) -> dict:
    """Amendment 4's power.budget: oracle cells kept at power.oracle_items, streaming cells at C6's minimum (the
    design's runs per class over the pilot's rarer class rate, three Poisson runs an item) if that leaves
    ``min_qa_items`` question-aware items, every other cell scaled by one factor."""
    c6 = power["c6"]
    c6_min = math.ceil(int(doc["power"]["span_targets"]["c6_design_runs_per_class"])
                       / (3 * min(c6["p_inh"], c6["p_cache"])))
    out = design(population, power, timing, budget_seconds, seeds, c6_min, prereg=int(doc["version"]),
                 oracle_items=doc["power"].get("oracle_items") or {}, spec=spec, plan=plan)
    return {"rule": f"amendment {doc['version']}'s power.budget", "c6_min_streaming_items": c6_min, **out}


def design_per_configuration(population: dict, power: dict, timing: dict[str, dict], budget_seconds: float,
                             seeds: dict[str, int], *, prereg: int, plan) -> dict:
    """Amendment 5's power.budget: the powered design (power.yaml's items per model) and the 90-minute one. Kept
    in order: the oracle cells at power's oracle items, the streaming cells at C6's floor, then every
    question-aware cell scaled by one common factor f (``resize``, rounded down) to fill the budget. If the first
    two alone do not fit, the oracle cells keep their items, the streaming cells are scaled with the question-aware
    ones, and ``c6_floor_kept`` is false. A cell type's cost per item is the sum over its cells of their measured
    medians (timing.yaml), since its cells all run the type's items. plan: population, counts, seeds -> cells."""
    per_model = power["per_model"]
    models = list(population["models"])
    full = {}
    for model in models:
        full.update({f"qa-{model}": int(per_model["question_aware"]), f"oracle-{model}": int(per_model["oracle"]),
                     f"streaming-{model}": int(per_model["streaming"])})
    cells_of = {}
    for name in plan(population, full, seeds):
        cells_of.setdefault(cell_type(name), []).append(name)
    missing = [c for names in cells_of.values() for c in names if c not in timing]
    if missing:
        raise SystemExit(f"timing.yaml: no measured time for cell(s) {', '.join(missing)}")
    cost = {t: sum(float(timing[c]["per_item_median"]) for c in names) for t, names in cells_of.items()}
    floor = {m: min(int(per_model["streaming_c6_floor"]), full[f"streaming-{m}"]) for m in models}
    cells = {t: {"items": full[t], "seconds": full[t] * cost[t], "per_item_median": cost[t]} for t in full}
    for m in models:
        cells[f"streaming-{m}"] = {**cells[f"streaming-{m}"], "items": floor[m], "seconds": floor[m] * cost[f"streaming-{m}"]}
    kept = sum(e["seconds"] for t, e in cells.items() if t.startswith(("oracle", "streaming")))
    if kept < budget_seconds:
        scaled = {**resize(cells, budget_seconds, keep=("oracle", "streaming")), "c6_floor_kept": True}
    else:
        for m in models:
            cells[f"streaming-{m}"] = {**cells[f"streaming-{m}"], "items": full[f"streaming-{m}"],
                                       "seconds": full[f"streaming-{m}"] * cost[f"streaming-{m}"]}
        scaled = {**resize(cells, budget_seconds, keep=("oracle",)), "c6_floor_kept": False}
    return {"cost_per_item": {t: round(c, 2) for t, c in sorted(cost.items())},
            "powered": {"counts": full, "estimated_cell_seconds": round(sum(full[t] * cost[t] for t in full)),
                        "study": {"prereg": prereg, "cells": plan(population, full, seeds)}},
            "reproduce_90_minutes": {**scaled, "study": {"prereg": prereg,
                                                         "cells": plan(population, scaled["counts"], seeds)}},
            "fits": all(scaled["counts"][t] >= full[t] for t in full)}


@register_method("design", "floors_then_scale")
def floors_then_scale(doc: dict, spec: dict, population: dict, power: dict, timing: dict, budget_seconds: float,
                      seeds: dict[str, int], plan) -> dict:
    """Amendment 5's power.budget (``design_per_configuration``) over the plan's cells."""
    out = design_per_configuration(population, power, timing, budget_seconds, seeds, prereg=int(doc["version"]),
                                   plan=functools.partial(plan, spec=spec))
    return {"rule": f"amendment {doc['version']}'s power.budget", **out}


@register_method("design", "c3_first_then_scale")
def c3_first_then_scale(doc: dict, spec: dict, population: dict, power: dict, timing: dict, budget_seconds: float,
                        seeds: dict[str, int], plan) -> dict:
    """Amendment 6's power.budget: the powered design (power.yaml's items per model) and the 90-minute one, which
    keeps the question-aware and streaming cells at ``power.ninety_minutes``' items per model (never above the
    powered counts) and scales every oracle cell by one common factor (``resize``, rounded down, at most 1) to fill
    the budget: C3 first. A cell type's cost per item is the sum of its cells' measured medians (timing.yaml)."""
    cells_of = functools.partial(plan, spec=spec)
    per_model, fixed = power["per_model"], doc["power"]["ninety_minutes"]
    full, kept = {}, {}
    for model in population["models"]:
        full.update({f"qa-{model}": int(per_model["question_aware"]), f"oracle-{model}": int(per_model["oracle"]),
                     f"streaming-{model}": int(per_model["streaming"])})
        kept.update({f"qa-{model}": min(int(fixed["question_aware_per_model"]), full[f"qa-{model}"]),
                     f"streaming-{model}": min(int(fixed["streaming_per_model"]), full[f"streaming-{model}"])})
    types: dict[str, list[str]] = {}
    for name in cells_of(population, full, seeds):
        types.setdefault(cell_type(name), []).append(name)
    missing = [c for names in types.values() for c in names if c not in timing]
    if missing:
        raise SystemExit(f"timing.yaml: no measured time for cell(s) {', '.join(missing)}")
    cost = {t: sum(float(timing[c]["per_item_median"]) for c in names) for t, names in types.items()}
    cells = {t: {"items": n, "seconds": n * cost[t], "per_item_median": cost[t]} for t, n in {**full, **kept}.items()}
    scaled = resize(cells, budget_seconds, keep=("qa", "streaming"))
    return {"rule": f"amendment {doc['version']}'s power.budget",
            "cost_per_item": {t: round(c, 2) for t, c in sorted(cost.items())},
            "powered": {"counts": full, "estimated_cell_seconds": round(sum(full[t] * cost[t] for t in full)),
                        "study": {"prereg": int(doc["version"]), "cells": cells_of(population, full, seeds)}},
            "reproduce_90_minutes": {**scaled, "study": {"prereg": int(doc["version"]),
                                                         "cells": cells_of(population, scaled["counts"], seeds)}},
            "fits": all(scaled["counts"][t] >= full[t] for t in full)}


def main() -> None:
    import sys

    if sys.argv[1:2] in (["time"], ["design"]):
        return amendment_main(sys.argv[1], sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=Path, required=True, help="a study's cells/ folder")
    parser.add_argument("--budget-minutes", type=float, required=True, help="wall minutes of cells")
    parser.add_argument("--cores", type=int, default=2, help="cells run at a time")
    parser.add_argument("--keep", nargs="*", default=["oracle"], help="cell-name prefixes whose counts stay")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cells = measured(args.cells)
    result = resize(cells, args.budget_minutes * 60 * args.cores, tuple(args.keep))
    doc = {"rule": __doc__.split("\n\n")[2].replace("\n", " "),
           "inputs": {"cells": str(args.cells), "budget_minutes": args.budget_minutes, "cores": args.cores,
                      "keep": args.keep},
           "measured": {c: {"items": e["items"], "shards": e["shards"], "cell_seconds": round(e["seconds"], 1),
                            "per_item_median_s": round(e["per_item_median"], 2)} for c, e in cells.items()},
           **result}
    text = yaml.safe_dump(doc, sort_keys=False, width=110)
    if args.out:
        write_text_atomic(text, args.out)
    print(text, end="")


def _pilot_script():
    """workflow/scripts/pilot.py as a module: its reader of an amendment's data (document and sidecar)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pilot", Path(__file__).with_name("pilot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def amendment_main(command: str, argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=f"an amendment's design: {command}")
    parser.add_argument("--amendment", type=Path, required=True)
    parser.add_argument("--population", type=Path, required=True)
    parser.add_argument("--cells", type=Path, help="time: the timing cells' folder")
    parser.add_argument("--timing", type=Path, required=True, help="the measured times (time: written; design: read)")
    parser.add_argument("--power", type=Path, help="design: power.yaml")
    parser.add_argument("--out", type=Path, help="design: design.yaml")
    parser.add_argument("--cores", type=int, default=2, help="cells at a time, where power.timing names no cores")
    parser.add_argument("--smoke", action="store_true",
                        help="time and design: the plan on almost nothing (two scorers, two allocators, each factor's "
                             "ends, one Poisson seed)")
    args = parser.parse_args(argv)
    pilot = _pilot_script()
    doc = pilot.amendment_data(args.amendment)
    where = pilot.source_of(args.amendment, "plan")
    spec = plan_of(doc, where)
    spec = smoke_spec(spec) if args.smoke else spec
    population = yaml.safe_load(args.population.read_text())
    timing = doc["power"]["timing"]
    plan = method("plan", spec["method"], f"{where}: plan.method")
    if command == "time":
        time_cells(population, args.cells, int(timing["n_items"]), int(doc["pilot"]["items_seed"]), args.cores,
                   functools.partial(plan, spec=spec), pilot.run_cells)
        cells = measured(args.cells)
        text = yaml.safe_dump({"rule": "per item: median over a cell's shards of wall seconds / items (manifest.json)",
                               "inputs": {"cells": str(args.cells), "n_items": timing["n_items"],
                                          "items_seed": doc["pilot"]["items_seed"], "cores": args.cores},
                               "measured": {c: {"items": e["items"], "shards": e["shards"],
                                                "cell_seconds": round(e["seconds"], 1),
                                                "per_item_median": round(e["per_item_median"], 2)}
                                            for c, e in cells.items()}}, sort_keys=False, width=110)
        write_text_atomic(text, args.timing)
    else:
        if args.power is None or args.out is None:
            parser.error("design needs --power and --out")
        rule = method("design", spec["design"], f"{where}: plan.design")
        out = rule(doc, spec, population, yaml.safe_load(args.power.read_text()),
                   yaml.safe_load(args.timing.read_text())["measured"],
                   float(timing["budget_minutes"]) * 60 * int(timing.get("cores", args.cores)),
                   {k: int(v) for k, v in doc["power"]["items_seeds"].items()}, plan)
        text = yaml.safe_dump(out, sort_keys=False, width=110)
        write_text_atomic(text, args.out)
    print(text, end="")


if __name__ == "__main__":
    main()

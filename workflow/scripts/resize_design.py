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
import json
import math
import statistics
from pathlib import Path

import yaml

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


# --- amendment 4: the planned cells, their timing run and the design ---------------------------------------------

# Amendment 2's oracle cells (C3's step tables), kept by amendment 4, whose document states them in prose only; a
# later amendment states its own as data (power.oracle_items: {model: items}).
ORACLE_ITEMS = {"smollm2": 30, "gemma3": 16}
ITEMS_PER_SHARD = 35  # about v3's shards (206 items in 6): a lost shard costs little, shards balance two cores
KINDS = ("qa", "oracle", "streaming")
MIN_QA_ITEMS = 100  # question-aware items (pooled) C6's streaming floor must leave in the scaled design


def _flow(value) -> str:
    """A Hydra override value in flow style without spaces: {name:vt,num_hops:1}."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_flow(v) for v in value) + "]"
    return str(value)


def planned_cells(population: dict, counts: dict[str, int], seeds: dict[str, int]) -> dict[str, dict]:
    """Scale-file cells (name -> {model, shards, overrides}) of amendment 4's design: per model a question-aware,
    an oracle and a streaming cell with amendment 2's configurations, the model's tasks, SnapKV window and kernel.

    counts: items per cell name (e.g. "qa-smollm2"); seeds: data seeds {"qa": .., "oracle": .., "streaming": ..}.
    """
    out = {}
    for model, chosen in population["models"].items():
        knobs = [f"observation_window={chosen['window']}", f"policy_options={{snapkv:{{kernel_size:{chosen['kernel']}}}}}",
                 "policies=[snapkv]", "seeds=[0,1,2]"]
        for kind in KINDS:
            name = f"{kind}-{model}"
            tasks = chosen["streaming"] if kind == "streaming" else chosen["question_aware"]
            grid = (["setting=streaming", "designs=[poisson]", "budgets=[0.25]", "oracle=false", "store_steps=false"]
                    if kind == "streaming" else
                    ["setting=question_aware", "designs=[topk,poisson]", "budgets=[0.25,0.5]"]
                    + (["extra_grids=[{policies:[uniform],designs:[poisson],budgets:[0.25]}]", "oracle=true"]
                       if kind == "oracle" else ["oracle=false", "store_steps=false"]))
            out[name] = {"model": model, "shards": max(1, math.ceil(counts[name] / ITEMS_PER_SHARD)),
                         "overrides": ["data=ruler", f"data.tasks={_flow(tasks)}", f"data.seed={seeds[kind]}",
                                       *knobs, f"n_items={counts[name]}", *grid]}
    return out


def time_cells(population: dict, out_dir: Path, n_items: int, seed: int, cores: int, plan=None) -> Path:
    """Run every planned cell on ``n_items`` pilot items (data seed ``seed``), ``cores`` cells at a time with one
    thread each, as `make reproduce` runs them; returns ``out_dir`` (one shard-0 per cell, read by ``measured``).
    Only the manifests' wall seconds are read; the answers are not."""
    import shutil
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    counts = {f"{kind}-{model}": n_items for model in population["models"] for kind in KINDS}
    cells = (plan or planned_cells)(population, counts, {kind: seed for kind in KINDS})
    command = [str(Path(sys.executable).with_name("kvcert-run"))]

    def run(item):
        name, cell = item
        target = out_dir / name / "shard-0"
        if (target / "manifest.json").is_file():
            return
        args = [*command, f"model={cell['model']}", *cell["overrides"], "threads=1", "progress=false", f"out_dir={target}"]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"timing cell {name} failed: {done.stderr.strip().splitlines()[-1:]}")

    out_dir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=cores) as pool:
        list(pool.map(run, cells.items()))
    for leftover in out_dir.glob("*/shard-0/.parts"):
        shutil.rmtree(leftover, ignore_errors=True)
    return out_dir


def design(population: dict, power: dict, timing: dict[str, dict], budget_seconds: float, seeds: dict[str, int],
           c6_min_items: int, *, prereg: int, oracle_items: dict[str, int] | None = None) -> dict:
    """The powered design and, when it does not fit the budget, the scaled one (``resize``'s rule); each
    streaming cell keeps at least ``c6_min_items`` / number of models items (C6's failing runs per class);
    ``prereg``: the version the studies apply (the amendment document's ``version``)."""
    models = list(population["models"])
    per_model = power["per_model"]
    full = {}
    for model in models:
        full[f"qa-{model}"] = per_model["question_aware"]
        full[f"streaming-{model}"] = per_model["streaming"]
        full[f"oracle-{model}"] = int((oracle_items or ORACLE_ITEMS).get(model, 16))
    cost = {c: timing[c]["per_item_median"] for c in full}
    cells = {c: {"items": n, "seconds": n * cost[c], "per_item_median": cost[c]} for c, n in full.items()}
    scaled = resize(cells, budget_seconds, keep=("oracle",))
    scaled["c6_floor_kept"] = False
    floor = math.ceil(c6_min_items / len(models))
    if any(scaled["counts"][f"streaming-{m}"] < min(floor, full[f"streaming-{m}"]) for m in models):
        # The streaming cells keep C6's minimum and the question-aware cells take what is left, if that leaves
        # them MIN_QA_ITEMS; otherwise the uniform scaling stands and only the powered study meets C6's count.
        floored = dict(cells)
        for m in models:
            n = min(floor, full[f"streaming-{m}"])
            floored[f"streaming-{m}"] = {"items": n, "seconds": n * cost[f"streaming-{m}"],
                                         "per_item_median": cost[f"streaming-{m}"]}
        fixed = sum(e["seconds"] for c, e in floored.items() if c.startswith(("oracle", "streaming")))
        if fixed < budget_seconds:
            attempt = resize(floored, budget_seconds, keep=("oracle", "streaming"))
            if sum(n for c, n in attempt["counts"].items() if c.startswith("qa")) >= MIN_QA_ITEMS:
                scaled = {**attempt, "c6_floor_kept": True}
    out = {"powered": {"counts": full, "estimated_cell_seconds": round(sum(full[c] * cost[c] for c in full)),
                       "study": {"prereg": prereg, "cells": planned_cells(population, full, seeds)}},
           "reproduce_90_minutes": {**scaled, "study": {"prereg": prereg, "cells": planned_cells(population, scaled["counts"], seeds)}}}
    out["fits"] = scaled["factor"] >= 1.0 and all(scaled["counts"][c] >= full[c] for c in full)
    return out


# --- amendment 5: every scorer, allocator and certain-head share, one cell per (allocator, share) -----------------

# Amendment 5's factors (changes.scorers, changes.allocators, changes.certain_head_share). The scorers are the rule's
# result at the lock commit: every kvcert policy that tests/test_peers.py compares with a kvpress 0.5.5 press (the
# press named here; where the definitions differ the test states and checks the difference) and that needs no
# trained weights. tests/test_amendment5_design.py checks that every registered policy is here or in
# SCORERS_5_LEFT_OUT with its reason, and that every scorer's press is compared in tests/test_peers.py.
SCORER_PRESSES_5 = {"snapkv": "SnapKVPress", "h2o": "ObservedAttentionPress", "tova": "TOVAPress",
                    "knorm": "KnormPress", "expected_attention": "ExpectedAttentionPress",
                    "criticalkv": "CriticalKVPress", "observed_attention": "ObservedAttentionPress",
                    "keydiff": "KeyDiffPress", "lagkv": "LagKVPress", "cur": "CURPress",
                    "leverage": "LeverageScorePress", "cap": "CapPress"}
SCORERS_5 = tuple(SCORER_PRESSES_5)
SCORERS_5_LEFT_OUT = {
    "streamingllm": "keeps sinks and the recent window by position: top-k of a position rule is the rule itself",
    "uniform": "samples every token alike: it ranks nothing, so it has no top-k to compare with"}
# Allocator -> the scorers it runs over (AdaKV and PyramidKV over snapkv only: the amendment's cost argument).
ALLOCATORS_5 = {"uniform": SCORERS_5, "adakv": ("snapkv",), "pyramidkv": ("snapkv",)}
SHARES_5 = (0.5, 0.8, 0.95)
DEFAULT_SHARE, DEFAULT_ALLOCATOR = 0.5, "uniform"  # kvcert.run_schema' head_fraction and allocator


def _pooling(scorer: str) -> bool:
    """Whether a scorer pools its scores with a kernel (a ``kernel_size`` option): the population's K applies."""
    import dataclasses as dc

    from kvcert.policies import POLICIES

    return "kernel_size" in {f.name for f in dc.fields(POLICIES[scorer])}


def configuration_cells(population: dict, counts: dict[str, int], seeds: dict[str, int], *,
                        scorers=SCORERS_5, allocators=None, shares=SHARES_5, poisson_seeds=(0, 1, 2)) -> dict[str, dict]:
    """Scale-file cells of amendment 5's design. Per model: the question-aware and oracle cell types, each one
    cell per (allocator, share) because a cell runs one allocator and one design_options.head_fraction; and the
    streaming cell, amendment 4's. Top-k does not depend on the share: it runs in the share-0.5 cell only, the
    reference of Poisson at every share. The oracle cells run Poisson only (C3). Every cell of a type has the same
    items (data seed and count), so the configurations pair per item across cells.

    A cell is named <kind>-<model>, then -<allocator> unless uniform, then -share<h> unless 0.5.
    The analysis (kvcert.analysis.strata) tells configurations apart by the tables' allocator and head_fraction
    columns, a missing one read as the default: a study of these cells needs a runner that writes head_fraction
    (items and steps) and allocator (steps) for a cell off the default. The timing cells read times only.
    counts: items per cell *type* ("qa-smollm2", "oracle-smollm2", "streaming-smollm2"); seeds: data seeds by kind.
    """
    allocators = ALLOCATORS_5 if allocators is None else allocators
    seed_list = "[" + ",".join(map(str, poisson_seeds)) + "]"
    out = {}
    for model, chosen in population["models"].items():
        window, kernel = chosen["window"], chosen["kernel"]
        for kind in ("qa", "oracle"):
            data = ["data=ruler", f"data.tasks={_flow(chosen['question_aware'])}", f"data.seed={seeds[kind]}",
                    f"n_items={counts[f'{kind}-{model}']}"]
            for allocator, over in allocators.items():
                for share in shares:
                    designs = ["poisson"] if kind == "oracle" or share != DEFAULT_SHARE else ["topk", "poisson"]
                    pooled = {s: {"kernel_size": kernel} for s in over if _pooling(s)}
                    name = (f"{kind}-{model}" + (f"-{allocator}" if allocator != DEFAULT_ALLOCATOR else "")
                            + (f"-share{share:g}" if share != DEFAULT_SHARE else ""))
                    out[name] = {"model": model, "kind": kind,
                                 "shards": max(1, math.ceil(counts[f"{kind}-{model}"] / ITEMS_PER_SHARD)),
                                 "overrides": [
                                     *data, f"observation_window={window}",
                                     *([f"policy_options={_flow(pooled)}"] if pooled else []),
                                     f"policies={_flow(list(over))}", f"seeds={seed_list}",
                                     *([f"allocator={allocator}"] if allocator != DEFAULT_ALLOCATOR else []),
                                     *([f"design_options.head_fraction={share:g}"] if share != DEFAULT_SHARE else []),
                                     "setting=question_aware", f"designs={_flow(designs)}", "budgets=[0.25,0.5]",
                                     *(["oracle=true"] if kind == "oracle" else ["oracle=false", "store_steps=false"])]}
        n = counts[f"streaming-{model}"]
        out[f"streaming-{model}"] = {
            "model": model, "kind": "streaming", "shards": max(1, math.ceil(n / ITEMS_PER_SHARD)),
            "overrides": ["data=ruler", f"data.tasks={_flow(chosen['streaming'])}", f"data.seed={seeds['streaming']}",
                          f"n_items={n}", f"observation_window={window}",
                          f"policy_options={{snapkv:{{kernel_size:{kernel}}}}}", "policies=[snapkv]",
                          f"seeds={seed_list}", "setting=streaming", "designs=[poisson]", "budgets=[0.25]",
                          "oracle=false", "store_steps=false"]}
    return out


def smoke_configuration_cells(population: dict, counts: dict[str, int], seeds: dict[str, int]) -> dict[str, dict]:
    """The code path of ``configuration_cells`` on almost nothing: two scorers, two allocators, the smallest and
    largest share, one Poisson seed (proves every cell kind runs; its times size nothing)."""
    return configuration_cells(population, counts, seeds, scorers=SCORERS_5[:2],
                               allocators={"uniform": SCORERS_5[:2], "adakv": ("snapkv",)},
                               shares=(SHARES_5[0], SHARES_5[-1]), poisson_seeds=(0,))


def cell_type(name: str) -> str:
    """The cell type of a configuration cell's name: "qa-smollm2-adakv-share0.8" -> "qa-smollm2"."""
    return "-".join(name.split("-")[:2])


def design_per_configuration(population: dict, power: dict, timing: dict[str, dict], budget_seconds: float,
                             seeds: dict[str, int], *, prereg: int, plan=configuration_cells) -> dict:
    """Amendment 5's power.budget: the powered design (power.yaml's items per model) and the 90-minute one. Kept
    in order: the oracle cells at power's oracle items, the streaming cells at C6's floor, then every
    question-aware cell scaled by one common factor f (``resize``, rounded down) to fill the budget. If the first
    two alone do not fit, the oracle cells keep their items, the streaming cells are scaled with the question-aware
    ones, and ``c6_floor_kept`` is false. A cell type's cost per item is the sum over its cells of their measured
    medians (timing.yaml), since its cells all run the type's items."""
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


def amendment4_cells(population: dict, counts: dict[str, int], seeds: dict[str, int]) -> dict[str, dict]:
    return planned_cells(population, counts, seeds)


# The cell plan of an amendment's design, by its power method (kvcert.analysis.prereg.Version.power): amendment 4's
# one cell per (kind, model), amendment 5's one cell per (kind, model, allocator, share). ``time`` runs each plan's
# cells on the pilot items; ``design`` applies the matching rule to the measured times.
PLANS = {"studies_span_targets": amendment4_cells, "per_component_span": configuration_cells}
SMOKE_PLANS = {"per_component_span": smoke_configuration_cells}


def main() -> None:
    import sys

    if sys.argv[1:2] in (["time"], ["design"]):
        return amendment4_main(sys.argv[1], sys.argv[2:])
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


def amendment4_main(command: str, argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=f"amendment 4: {command}")
    parser.add_argument("--amendment", type=Path, required=True)
    parser.add_argument("--population", type=Path, required=True)
    parser.add_argument("--cells", type=Path, help="time: the timing cells' folder")
    parser.add_argument("--timing", type=Path, required=True, help="the measured times (time: written; design: read)")
    parser.add_argument("--power", type=Path, help="design: power.yaml")
    parser.add_argument("--out", type=Path, help="design: design.yaml")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help="time and design: the plan's smoke version (amendment 5's: fewer scorers, allocators, "
                             "shares and seeds)")
    args = parser.parse_args(argv)
    doc = yaml.safe_load(args.amendment.read_text())
    population = yaml.safe_load(args.population.read_text())
    timing = doc["power"]["timing"]
    method = doc["power"].get("method", "studies_span_targets")
    if method not in PLANS:
        raise SystemExit(f"{args.amendment}: power.method={method!r}: no cell plan; known: {', '.join(sorted(PLANS))}")
    if command == "time":
        if args.smoke and method not in SMOKE_PLANS:
            raise SystemExit(f"--smoke: power.method={method} has no smoke plan")
        plan = SMOKE_PLANS[method] if args.smoke else PLANS[method]
        time_cells(population, args.cells, int(timing["n_items"]), int(doc["pilot"]["items_seed"]), args.cores, plan)
        cells = measured(args.cells)
        text = yaml.safe_dump({"rule": "per item: median over a cell's shards of wall seconds / items (manifest.json)",
                               "inputs": {"cells": str(args.cells), "n_items": timing["n_items"],
                                          "items_seed": doc["pilot"]["items_seed"], "cores": args.cores},
                               "measured": {c: {"items": e["items"], "shards": e["shards"],
                                                "cell_seconds": round(e["seconds"], 1),
                                                "per_item_median": round(e["per_item_median"], 2)}
                                            for c, e in cells.items()}}, sort_keys=False, width=110)
        write_text_atomic(text, args.timing)
    elif method == "per_component_span":
        power = yaml.safe_load(args.power.read_text())
        measured_times = yaml.safe_load(args.timing.read_text())["measured"]
        out = design_per_configuration(population, power, measured_times,
                                       float(timing["budget_minutes"]) * 60 * int(timing.get("cores", args.cores)),
                                       {k: int(v) for k, v in doc["power"]["items_seeds"].items()},
                                       prereg=int(doc["version"]),
                                       plan=SMOKE_PLANS[method] if args.smoke else PLANS[method])
        text = yaml.safe_dump({"rule": f"amendment {doc['version']}'s power.budget", **out}, sort_keys=False, width=110)
        write_text_atomic(text, args.out)
    else:
        power = yaml.safe_load(args.power.read_text())
        measured_times = yaml.safe_load(args.timing.read_text())["measured"]
        c6 = power["c6"]
        c6_min = math.ceil(int(doc["power"]["span_targets"]["c6_design_runs_per_class"])
                           / (3 * min(c6["p_inh"], c6["p_cache"])))
        out = design(population, power, measured_times, float(timing["budget_minutes"]) * 60 * args.cores,
                     {k: int(v) for k, v in doc["power"]["items_seeds"].items()}, c6_min, prereg=int(doc["version"]),
                     oracle_items=doc["power"].get("oracle_items"))
        text = yaml.safe_dump({"rule": f"amendment {doc['version']}'s power.budget", "c6_min_streaming_items": c6_min, **out},
                              sort_keys=False, width=110)
        write_text_atomic(text, args.out)
    print(text, end="")


if __name__ == "__main__":
    main()

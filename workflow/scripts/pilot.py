"""The pilot of a pre-registration amendment: run its stages on pilot items and apply its rules.

    python workflow/scripts/pilot.py --method staged --amendment preregistration/amendment-4.yaml --model smollm2 --out pilot-smollm2.csv
    python workflow/scripts/pilot.py choose --amendment preregistration/amendment-4.yaml \
        --pilot pilot-smollm2.csv pilot-gemma3.csv --csv pilot.csv --out population.yaml

The method is named by the amendment's data (``--method``, from kvcert.analysis.prereg.Version.pilot), not by
its number. Method ``threshold`` (amendment 2's; ``pilot.families`` and ``pilot.threshold``): full-cache accuracy of each family's variants in order,
curtailed as soon as a variant can no longer reach ``pilot.threshold``; a family stops at its first passing
variant (``--round 2``: the variants of ``pilot.round_2``).

Method ``staged`` (amendment 4's; ``pilot.stage_a`` .. ``stage_d``), one model per process: stage A, full-cache accuracy of every
variant, curtailed once its band is out of reach; stage B, SnapKV top-k at 50% over the window x kernel grid on
the stage-B tasks; stage C, top-k and Poisson at 25% (question-aware) at the chosen pair; stage D, the streaming
full cache and Poisson at 25% at the chosen pair. The decisions between stages are the amendment's rules
(``stage_b_tasks``, ``choose_pair``, ``population``), the same functions ``choose`` applies to the finished rows,
so the population written is the one the stages ran on. One CSV row per (stage, variant, configuration): the
accuracy (mean over items of the mean over seeds), items and runs, whether curtailed, CPU seconds per item.

Method ``reuse_population`` (amendment 5's; ``pilot.population_from``), no model and no stage: the population is
a locked earlier amendment's, copied unchanged (its models restricted to ``pilot.models``) with a note of where
it came from and the file's sha256; the amendment's only pilot computation is then its timing cells
(resize_design.py time).

    python workflow/scripts/pilot.py --method reuse_population --amendment preregistration/amendment-5/amendment.yaml \
        --out preregistration/amendment-5/population.yaml

Method ``smallest_defense_covering`` (amendment 6's; ``pilot.grid``, ``pilot.share``, ``pilot.target``): the reused
population, then the pilot's oracle cells (every scorer and allocator of the plan at ``pilot.share``, for every grid
point of the certificate's two defenses) on pilot items, and the rule ``smallest_covering``: the smallest
(eta, lambda), eta first, at which every configuration's pilot coverage reaches ``pilot.target``. Its estimated cost
(from ``pilot.cost_from``'s measured times) is printed first; ``--estimate`` prints it and runs nothing.

    python workflow/scripts/pilot.py --method smallest_defense_covering --estimate \
        --amendment preregistration/amendment-6/amendment.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import yaml

from kvcert.analysis.registry import methods, register_method
from kvcert.atomic import write_text_atomic

COLUMNS = ["round", "model", "family", "task", "n_run", "n_correct", "accuracy", "passed", "curtailed", "cpu_s_per_item",
           "prompt_tokens_mean"]
# Amendment 4's rows.
COLUMNS_4 = ["model", "stage", "family", "task", "context_tokens", "window", "kernel", "setting", "design", "budget",
             "n_items", "n_runs", "n_correct", "accuracy", "curtailed", "cpu_s_per_item", "n_fail_inherent",
             "n_fail_cache"]
FAMILY_ORDER = ("retrieval", "multi_hop_tracing", "aggregation")
DEFAULT_PAIR = (16, 5)  # versions 1-3's SnapKV window and kernel: first in the tie order
POISSON_SEEDS = (0, 1, 2)


def shown_path(path: Path) -> str:
    """A path as a committed file states it: relative to the repository when inside it."""
    repo = Path(__file__).resolve().parents[2]
    path = Path(path).resolve()
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


# --- an amendment's data: its document, and for a locked document that states some keys in words only, its sidecar ---

SIDECAR = "spec.yaml"


def _sidecar_of(document: Path) -> tuple[Path, Path]:
    """(sidecar, lock) of an amendment document: a folder amendment's (amendment-N/amendment.yaml) sit beside it, an
    indexed one's (amendment-N.yaml) are amendment-N/spec.yaml and amendment-N.lock."""
    document = Path(document)
    if document.name == "amendment.yaml":
        return document.parent / SIDECAR, document.parent / "amendment.lock"
    return document.with_suffix("") / SIDECAR, document.with_suffix(".lock")


def _fill(doc: dict, extra: dict, where: str, path: str = "") -> dict:
    """``doc`` with the keys of ``extra`` it lacks (mappings merged key by key); a key both state is an error."""
    out = dict(doc)
    for key, value in extra.items():
        here = f"{path}{key}"
        if key not in out:
            out[key] = value
        elif isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = _fill(out[key], value, where, here + ".")
        else:
            raise SystemExit(f"{where}: {here}: the document states it; a sidecar only fills keys the locked "
                             "document lacks")
    return out


def amendment_data(document: Path) -> dict:
    """An amendment's document as data: the YAML itself, and, where the document is locked and lacks keys that a
    later rule reads (its plan, its power targets), the keys its sidecar (``SIDECAR``) states. A draft states them
    itself: a sidecar beside a draft is an error, so the sidecar never stands in for the locked text."""
    document = Path(document)
    try:
        doc = yaml.safe_load(document.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise SystemExit(f"{shown_path(document)}: unreadable: {str(error).splitlines()[0]}")
    if not isinstance(doc, dict):
        raise SystemExit(f"{shown_path(document)}: expected a mapping (an amendment document)")
    sidecar, lock = _sidecar_of(document)
    if not sidecar.is_file():
        return doc
    where = shown_path(sidecar)
    if not lock.is_file():
        raise SystemExit(f"{where}: beside a document without a lock ({shown_path(lock)}): a draft states its "
                         "plan and power targets in the document itself")
    extra = yaml.safe_load(sidecar.read_text())
    if not isinstance(extra, dict):
        raise SystemExit(f"{where}: expected a mapping of the document's missing keys")
    return _fill(doc, extra, where)


def source_of(document: Path, key: str) -> str:
    """The file that states the top-level ``key`` of an amendment's data (the document, else its sidecar), as a
    committed file names it: errors about the key name that file."""
    doc = yaml.safe_load(Path(document).read_text())
    sidecar = _sidecar_of(document)[0]
    return shown_path(sidecar if isinstance(doc, dict) and key not in doc and sidecar.is_file() else document)


def _label(variant) -> str:
    return variant if isinstance(variant, str) else variant.get("label") or variant["name"]


# --- the staged pilot's rules (amendment 4's; pure functions of the pilot's rows) -----------------------------------


def variants_in_order(pilot: dict) -> list[tuple[str, dict]]:
    """(family, variant) in the amendment's order: families as listed, variants as listed within each."""
    return [(family, variant) for family, variants in pilot["families"].items() for variant in variants]


def in_band(value: float, band) -> bool:
    low, high = band
    return (low is None or value >= low - 1e-12) and (high is None or value <= high + 1e-12)


def band_distance(value: float, band) -> float:
    low, high = band
    return max(0.0, (low if low is not None else value) - value, value - (high if high is not None else value))


def _rows(rows: list[dict], model: str, stage: str, **match) -> list[dict]:
    return [r for r in rows if r["model"] == model and r["stage"] == stage
            and all(r[k] == v for k, v in match.items())]


def stage_a_accuracy(rows: list[dict], model: str) -> dict[str, float]:
    return {r["task"]: float(r["accuracy"]) for r in _rows(rows, model, "A")}


def in_band_tasks(rows: list[dict], model: str, pilot: dict) -> list[tuple[str, str]]:
    """(family, task) of the model's stage-A in-band variants, in the amendment's order."""
    acc = stage_a_accuracy(rows, model)
    band = pilot["stage_a"]["band"]
    return [(f, _label(v)) for f, v in variants_in_order(pilot) if _label(v) in acc and in_band(acc[_label(v)], band)]


def stage_b_tasks(rows: list[dict], model: str, pilot: dict) -> list[tuple[str, str]]:
    """Per family, the first in-band variant: the tasks the window x kernel grid is scored on."""
    out, seen = [], set()
    for family, task in in_band_tasks(rows, model, pilot):
        if family not in seen:
            seen.add(family)
            out.append((family, task))
    return out


def tie_order(pilot: dict) -> list[tuple[int, int]]:
    """(16, 5) first, then window ascending, then kernel ascending."""
    pairs = sorted((int(w), int(k)) for w in pilot["stage_b"]["windows"] for k in pilot["stage_b"]["kernels"])
    return ([DEFAULT_PAIR] if DEFAULT_PAIR in pairs else []) + [p for p in pairs if p != DEFAULT_PAIR]


def choose_pair(rows: list[dict], model: str, pilot: dict) -> tuple[int, int]:
    """The (window, kernel) with the highest stage-B top-k accuracy at 50%, tasks weighted equally; ties by
    ``tie_order``. A model without stage-B rows keeps (16, 5)."""
    scores = {}
    for pair in tie_order(pilot):
        found = _rows(rows, model, "B", window=pair[0], kernel=pair[1])
        if found:
            scores[pair] = sum(float(r["accuracy"]) for r in found) / len(found)
    if not scores:
        return DEFAULT_PAIR
    best = max(scores.values())
    return next(pair for pair in tie_order(pilot) if pair in scores and scores[pair] >= best - 1e-12)


def stage_c_ratio(rows: list[dict], model: str, task: str, full: float) -> float | None:
    """Pooled 25% question-aware accuracy (top-k and the three Poisson runs, each item's four runs averaged)
    over the task's stage-A full-cache accuracy."""
    found = _rows(rows, model, "C", task=task)
    if not found or full <= 0:
        return None
    runs = sum(int(r["n_runs"]) for r in found)
    return sum(float(r["accuracy"]) * int(r["n_runs"]) for r in found) / runs / full


def stage_d_ratio(rows: list[dict], model: str, task: str) -> float | None:
    """Streaming Poisson accuracy at 25% over the streaming full cache's, on the same items."""
    full = _rows(rows, model, "D", task=task, design="full")
    poisson = _rows(rows, model, "D", task=task, design="poisson")
    if not full or not poisson or float(full[0]["accuracy"]) <= 0:
        return None
    return float(poisson[0]["accuracy"]) / float(full[0]["accuracy"])


def population(rows: list[dict], pilot: dict, models: list[str]) -> dict:
    """Amendment 4's population from the pilot's rows: per model, the pair, the question-aware and streaming
    tasks (one per family at most) and every deviation rule that applied, in the amendment's words."""
    variant_of = {_label(v): (f, v) for f, v in variants_in_order(pilot)}
    out: dict = {"models": {}, "deviations": []}
    for model in models:
        acc = stage_a_accuracy(rows, model)
        pair = choose_pair(rows, model, pilot)
        candidates = in_band_tasks(rows, model, pilot)
        qa, streaming = {}, {}
        for family, task in candidates:
            ratio_c = stage_c_ratio(rows, model, task, acc[task])
            if family not in qa and ratio_c is not None and in_band(ratio_c, pilot["stage_c"]["band"]):
                qa[family] = task
            ratio_d = stage_d_ratio(rows, model, task)
            if family not in streaming and ratio_d is not None and in_band(ratio_d, pilot["stage_d"]["band"]):
                streaming[family] = task
        for family in pilot["families"]:
            if not any(f == family for f, _ in candidates):
                out["deviations"].append(f"{model}: no {family} variant in the full-cache band (rule 1: left out)")
        family_rank = {f: i for i, f in enumerate(pilot["families"])}
        order = {_label(v): i for i, (_, v) in enumerate(variants_in_order(pilot))}
        if not qa and acc:
            nearest = min(acc, key=lambda t: (band_distance(acc[t], pilot["stage_a"]["band"]),
                                              family_rank[variant_of[t][0]], order[t]))
            qa[variant_of[nearest][0]] = nearest
            out["deviations"].append(f"{model}: no question-aware task after stages A and C; enters with {nearest} "
                                     f"(full-cache accuracy {acc[nearest]:.3f}, nearest to the band; rule 2)")
        if not streaming:
            ratios = {t: stage_d_ratio(rows, model, t) for _, t in candidates}
            ratios = {t: r for t, r in ratios.items() if r is not None}
            if ratios:
                nearest = min(ratios, key=lambda t: (band_distance(ratios[t], pilot["stage_d"]["band"]),
                                                     family_rank[variant_of[t][0]], order[t]))
                why = f"stage-D ratio {ratios[nearest]:.3f}, nearest to the band"
            elif qa:
                nearest = next(iter(qa.values()))
                why = "no in-band variant: its question-aware task"
            else:
                nearest = None
            if nearest is not None:
                streaming[variant_of[nearest][0]] = nearest
                out["deviations"].append(f"{model}: no streaming task after stage D; enters with {nearest} ({why}; rule 3)")
        out["models"][model] = {
            "window": pair[0], "kernel": pair[1],
            "question_aware": [variant_of[t][1] for t in sorted(qa.values(), key=order.get)],
            "streaming": [variant_of[t][1] for t in sorted(streaming.values(), key=order.get)],
        }
    families = {variant_of[_label(v)][0] for m in out["models"].values() for v in m["question_aware"] + m["streaming"]}
    out["families"] = [f for f in pilot["families"] if f in families]
    if len(families) < 3:
        out["deviations"].append(f"{len(families)} of 3 families enter the study ({', '.join(out['families'])}; rule 4)")
    return out


# --- running the stages ---------------------------------------------------------------------------------------------


class Runner:
    """One model's pilot runs: items, prompts and decoding exactly as the cell runner makes them."""

    def __init__(self, model_name: str, pilot: dict, threads: int):
        import torch

        import kvcert
        from kvcert.generation import eos_ids
        from kvcert.prompts import model_limit

        torch.set_num_threads(threads)
        self.name, self.pilot = model_name, pilot
        self.model, self.tokenizer = kvcert.load_model(model_name)
        self.stop, self.limit = eos_ids(self.model, self.tokenizer), model_limit(self.model)
        self.options = kvcert.DesignOptions()
        self._items: dict[str, list] = {}

    def items(self, variant: dict, n: int) -> list:
        from kvcert.data import load_items

        label = _label(variant)
        if len(self._items.get(label, [])) < n:  # items never change when more are asked for (RULER's seeding)
            cfg = {"name": "ruler", "tasks": [variant], "seed": int(self.pilot["items_seed"])}
            self._items[label] = load_items("ruler", cfg, self.tokenizer, n)
        return self._items[label][:n]

    def outcomes(self, item, setting: str, configs: list[tuple], window: int = DEFAULT_PAIR[0],
                 kernels: tuple[int, ...] = (DEFAULT_PAIR[1],)) -> dict[tuple, bool]:
        """{(kernel, design, budget, seed): correct} for one item: one prefill at ``window``, one batch.

        configs: (design, budget, seed) with design "full", "topk" or "poisson"; each is run at every kernel
        (the full cache once).
        """
        from kvcert.data import is_correct, score_item
        from kvcert.generation import decode_batch, item_seed, prefill, select
        from kvcert.runner.cell import item_prompt

        prompt = item_prompt(self.tokenizer, item, setting, self.limit, "middle")
        state = prefill(self.model, prompt.prefix_ids, prompt.suffix_ids, setting=setting, observation_window=window,
                        policy_options={"snapkv": {"kernel_size": kernels[0]}})
        keys, selections = [], []
        for kernel in kernels:
            # A new kernel re-scores the same prefill (the scores are cached per state, so a copy per kernel).
            scored = dataclasses.replace(state, policy_options={"snapkv": {"kernel_size": kernel}}, _scores={})
            for design, budget, seed in configs:
                if design == "full":
                    if kernel == kernels[0]:
                        keys.append((None, "full", 1.0, 0))
                        selections.append(None)
                    continue
                keys.append((kernel, design, budget, seed))
                selections.append(select(scored, "snapkv", design, budget, item_seed(seed, item.id), self.options))
        decoded = decode_batch(self.model, state, selections, max_new_tokens=int(item.max_new_tokens),
                               stop_ids=self.stop, certify=False, randomized=[k[1] == "poisson" for k in keys])
        return {key: bool(is_correct(score_item(item, self.tokenizer.decode(d.token_ids, skip_special_tokens=True)),
                                     item.metric)) for key, d in zip(keys, decoded)}

    def row(self, stage, family, variant, setting, design, budget, window, kernel, per_item, cpu, curtailed=False,
            full=None):
        """per_item: one list of outcomes (runs) per item; full: the item's full-cache outcome, to count failing
        runs by class (inherent: the full cache fails too; cache-induced: it answers), C6's two classes."""
        runs = sum(len(o) for o in per_item)
        return {"model": self.name, "stage": stage, "family": family, "task": _label(variant),
                "context_tokens": int(variant.get("context_tokens", 0)), "window": window, "kernel": kernel,
                "setting": setting, "design": design, "budget": budget, "n_items": len(per_item), "n_runs": runs,
                "n_correct": sum(sum(o) for o in per_item),
                "accuracy": round(sum(sum(o) / len(o) for o in per_item) / len(per_item), 4), "curtailed": curtailed,
                "cpu_s_per_item": round(cpu / len(per_item), 3),
                "n_fail_inherent": None if full is None else sum(o.count(False) for o, f in zip(per_item, full) if not f),
                "n_fail_cache": None if full is None else sum(o.count(False) for o, f in zip(per_item, full) if f)}


def run_stage_a(runner: Runner, family: str, variant: dict) -> dict:
    pilot = runner.pilot
    n = int(pilot["n_items"])
    low, high = pilot["stage_a"]["band"]
    max_correct, max_failed = math.floor(high * n + 1e-9), n - math.ceil(low * n - 1e-9)
    per_item, cpu = [], 0.0
    for item in runner.items(variant, n):
        start = time.process_time()
        per_item.append([runner.outcomes(item, "question_aware", [("full", 1.0, 0)])[(None, "full", 1.0, 0)]])
        cpu += time.process_time() - start
        correct = sum(o[0] for o in per_item)
        if correct > max_correct or len(per_item) - correct > max_failed:
            break
    return runner.row("A", family, variant, "question_aware", "full", 1.0, None, None, per_item, cpu,
                      curtailed=len(per_item) < n)


def run_stage_b(runner: Runner, family: str, variant: dict) -> list[dict]:
    pilot = runner.pilot
    windows, kernels = [int(w) for w in pilot["stage_b"]["windows"]], tuple(int(k) for k in pilot["stage_b"]["kernels"])
    items = runner.items(variant, int(pilot["n_items_compressed"]))
    outcomes = {(w, k): [] for w in windows for k in kernels}
    cpu = 0.0
    for item in items:
        start = time.process_time()
        for w in windows:
            got = runner.outcomes(item, "question_aware", [("topk", 0.5, 0)], window=w, kernels=kernels)
            for k in kernels:
                outcomes[(w, k)].append([got[(k, "topk", 0.5, 0)]])
        cpu += time.process_time() - start
    share = cpu / len(outcomes)  # the grid's CPU time, spread evenly over its pairs
    return [runner.row("B", family, variant, "question_aware", "topk", 0.5, w, k, per, share) for (w, k), per in outcomes.items()]


STAGES_CD = {
    "C": ("question_aware", [("topk", 0.25, 0)] + [("poisson", 0.25, s) for s in POISSON_SEEDS]),
    "D": ("streaming", [("full", 1.0, 0)] + [("poisson", 0.25, s) for s in POISSON_SEEDS]),
}


def run_stage_cd(runner: Runner, family: str, variant: dict, pair: tuple[int, int], stage: str) -> list[dict]:
    """Stage C or D of one variant at the model's (window, kernel): one row per design."""
    setting, configs = STAGES_CD[stage]
    window, kernel = pair
    by_design: dict[str, list] = {}
    cpu = 0.0
    for item in runner.items(variant, int(runner.pilot["n_items_compressed"])):
        start = time.process_time()
        got = runner.outcomes(item, setting, configs, window=window, kernels=(kernel,))
        cpu += time.process_time() - start
        for design in dict.fromkeys(d for d, _, _ in configs):
            by_design.setdefault(design, []).append([v for key, v in got.items() if key[1] == design])
    full = [o[0] for o in by_design["full"]] if "full" in by_design else None
    return [runner.row(stage, family, variant, setting, design, 1.0 if design == "full" else 0.25, window, kernel,
                       per_item, cpu / len(by_design), full=full if design == "poisson" else None)
            for design, per_item in by_design.items()]


def _say(row: dict) -> None:
    print(", ".join(f"{k}={row[k]}" for k in COLUMNS_4), file=sys.stderr, flush=True)


def pilot_staged(runner: Runner, out: Path) -> list[dict]:
    """Stages A-D for one model. Rows are saved after every variant to ``<out>.partial``, and a rerun reuses the
    rows found there (the stages are deterministic: a resumed pilot writes what an uninterrupted one would);
    ``out`` is written at the end and the partial file removed."""
    pilot, model, rows = runner.pilot, runner.name, []
    partial = out.with_name(out.name + ".partial")
    found = [r for r in read_rows([partial]) if r["model"] == model] if partial.is_file() else []

    def stage(name: str, task: str, run) -> None:
        kept = [r for r in found if r["stage"] == name and r["task"] == task]
        rows.extend(kept or run())
        for row in ([] if kept else rows[-1:]):
            _say(row)
        write_text_atomic(_csv(rows, COLUMNS_4), partial)

    variant_of = {_label(v): v for _, v in variants_in_order(pilot)}
    for family, variant in variants_in_order(pilot):
        stage("A", _label(variant), lambda: [run_stage_a(runner, family, variant)])
    for family, task in stage_b_tasks(rows, model, pilot):
        stage("B", task, lambda: run_stage_b(runner, family, variant_of[task]))
    pair = choose_pair(rows, model, pilot)
    print(f"{model}: window {pair[0]}, kernel {pair[1]}", file=sys.stderr, flush=True)
    for family, task in in_band_tasks(rows, model, pilot):
        for name in ("C", "D"):
            stage(name, task, lambda: run_stage_cd(runner, family, variant_of[task], pair, name))
    write_text_atomic(_csv(rows, COLUMNS_4), out)
    partial.unlink(missing_ok=True)
    return rows


def _csv(rows: list[dict], columns: list[str]) -> str:
    return "\n".join([",".join(columns)] + [",".join("" if r[c] is None else str(r[c]) for c in columns) for r in rows]) + "\n"


def read_rows(paths: list[Path]) -> list[dict]:
    """Pilot rows of amendment 4's CSV files, typed."""
    import csv

    rows = []
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                for key in ("window", "kernel", "context_tokens", "n_items", "n_runs", "n_correct", "n_fail_inherent",
                            "n_fail_cache"):
                    r[key] = int(r[key]) if r.get(key) not in ("", None) else None
                for key in ("budget", "accuracy", "cpu_s_per_item"):
                    r[key] = float(r[key])
                r["curtailed"] = r["curtailed"] == "True"
                rows.append(r)
    return rows


# --- the threshold pilot (amendment 2's method) -----------------------------------------------------------------


def run_variant(model, tokenizer, variant, pilot: dict) -> dict:
    import kvcert
    from kvcert.data import is_correct, load_items, score_item
    from kvcert.generation import eos_ids
    from kvcert.prompts import model_limit
    from kvcert.runner.cell import item_prompt

    n, threshold = int(pilot["n_items"]), float(pilot["threshold"])
    allowed_failures = n - math.ceil(threshold * n)
    cfg = {"name": "ruler", "tasks": [variant], "seed": int(pilot["items_seed"]),
           "context_tokens": int(pilot["context_tokens"])}
    items = load_items("ruler", cfg, tokenizer, n)
    stop, limit = eos_ids(model, tokenizer), model_limit(model)
    correct = failed = 0
    cpu, tokens = 0.0, []
    for item in items:
        prompt = item_prompt(tokenizer, item, "question_aware", limit, "middle")
        start = time.process_time()
        state = kvcert.prefill(model, prompt.prefix_ids, prompt.suffix_ids)
        decoded = kvcert.decode(model, state, None, max_new_tokens=int(item.max_new_tokens), stop_ids=stop,
                                certify=False)
        cpu += time.process_time() - start
        tokens.append(state.context_tokens)
        ok = is_correct(score_item(item, tokenizer.decode(decoded.token_ids, skip_special_tokens=True)), item.metric)
        correct += ok
        failed += not ok
        if failed > allowed_failures:
            break
    run = correct + failed
    return {"task": _label(variant), "n_run": run, "n_correct": correct, "accuracy": round(correct / run, 4),
            "passed": failed <= allowed_failures and run == n, "curtailed": run < n,
            "cpu_s_per_item": round(cpu / run, 3), "prompt_tokens_mean": round(sum(tokens) / len(tokens), 1)}


@register_method("pilot", "threshold")
def pilot_threshold(args, pilot: dict) -> None:
    import torch

    import kvcert

    families = pilot["families"] if args.round == 1 else pilot[f"round_{args.round}"]["families"]
    torch.set_num_threads(args.threads)
    model, tokenizer = kvcert.load_model(args.model)
    rows = []
    for family, variants in families.items():
        for variant in variants:
            row = {"round": args.round, "model": args.model, "family": family,
                   **run_variant(model, tokenizer, variant, pilot)}
            rows.append(row)
            print(", ".join(f"{k}={row[k]}" for k in COLUMNS), file=sys.stderr, flush=True)
            if row["passed"]:
                break
    write_text_atomic(_csv(rows, COLUMNS), args.out)


# --- command line ---------------------------------------------------------------------------------------------------


def smoke_pilot(pilot: dict) -> dict:
    """The code path on almost nothing: 2 items, the first variant of the first family, every band wide open and
    a 2 x 1 grid (proves the stages run; its numbers decide nothing)."""
    family, variants = next(iter(pilot["families"].items()))
    out = {**pilot, "n_items": 2, "n_items_compressed": 2, "families": {family: variants[:1]}}
    out["stage_a"] = {**pilot["stage_a"], "band": [0.0, 1.0]}
    out["stage_b"] = {**pilot["stage_b"], "windows": [8, 16], "kernels": [5]}
    out["stage_c"] = {**pilot["stage_c"], "band": [0.0, None]}
    out["stage_d"] = {**pilot["stage_d"], "band": [0.0, None]}
    return out


@register_method("pilot", "staged", steps="per_model")
def staged_pilot(args, pilot: dict) -> None:
    """Stages A-D on one model (amendment 4's method), or its smoke version (``--smoke``)."""
    pilot_staged(Runner(args.model, smoke_pilot(pilot) if args.smoke else pilot, args.threads), args.out)


def reused_population(document: Path, pilot: dict) -> dict:
    """The population of ``pilot.population_from`` (a repository-relative file that an earlier lock freezes), its
    models restricted to ``pilot.models`` in that order; ``rules`` and ``deviations`` stay the source's (how it was
    chosen), ``reused_from`` and ``reused_sha256`` say where it comes from. The source's ``items_seed`` (its own
    pilot's items) is left out: the reusing amendment's pilot items are its own ``pilot.items_seed``."""
    from kvcert.analysis import prereg

    root = prereg.find_root(Path(document).resolve().parent)
    source = pilot.get("population_from")
    if not isinstance(source, str) or not (root / source).is_file():
        raise SystemExit(f"{shown_path(document)}: pilot.population_from={source!r}: expected a repository-relative "
                         "population.yaml of an earlier amendment")
    # Reusing an unlocked or changed population would let it differ from the one its lock recorded.
    recorded = prereg.read_lock(root, prereg.latest(root))["sha256"].get(source)
    if recorded is None:
        raise SystemExit(f"{shown_path(document)}: pilot.population_from={source}: no earlier lock freezes it")
    if recorded != prereg.sha256(root / source):
        raise SystemExit(f"{shown_path(document)}: pilot.population_from={source}: differs from the file its lock froze")
    found = yaml.safe_load((root / source).read_text())
    models = list(pilot.get("models") or found["models"])
    missing = [m for m in models if m not in found["models"]]
    if missing:
        raise SystemExit(f"{shown_path(document)}: pilot.models: {', '.join(missing)} not in {source}")
    return {"reused_from": source, "reused_sha256": prereg.sha256(root / source),
            **{k: v for k, v in found.items() if k not in ("models", "items_seed")},
            "models": {m: found["models"][m] for m in models}}


@register_method("pilot", "reuse_population", steps="whole")
def reuse_population(args, pilot: dict) -> None:
    """Amendment 5's method: an earlier amendment's locked population, reused (no stage runs)."""
    doc = reused_population(args.amendment, pilot)
    write_text_atomic(yaml.safe_dump(doc, sort_keys=False, width=110), args.out)


# --- the defensive pilot (amendment 6's): the smallest defense on a grid at which every configuration covers -------
#
# pilot.grid names the two defenses' values (design_options.head_attention_share, eta, and design_options.tail_mix,
# lambda); the pilot's oracle cells run every (scorer, allocator) of the plan at pilot.share for every grid point on
# pilot items (pilot.items_seed, pilot.n_items per model, pilot.poisson_seeds) and the rule below picks the point.

DEFENSES = ("head_attention_share", "tail_mix")  # eta, lambda: the rule's order (eta first)


def defense_order(points) -> list[tuple[float, float]]:
    """The grid's (eta, lambda) points, smallest first, eta first: by eta, then by lambda."""
    return sorted({(float(eta), float(lam)) for eta, lam in points})


def smallest_covering(coverage: dict[tuple[float, float], dict[str, float]], target: float) -> dict:
    """The pilot's rule on a coverage table: {(eta, lambda): {configuration: pilot coverage}}, every point with the
    same configurations. The first point in ``defense_order`` at which every configuration's coverage reaches
    ``target`` is chosen (covers: true). If none does, the point whose smallest coverage is largest is chosen, the
    earlier in ``defense_order`` on a tie (covers: false): the study then measures the best defense the grid has,
    and says that no point covered at the pilot."""
    if not coverage:
        raise SystemExit("pilot coverage: no grid point has a coverage")
    order = defense_order(coverage)
    configurations = set(coverage[order[0]])
    for point in order:
        if set(coverage[point]) != configurations or not configurations:
            missing = sorted(configurations ^ set(coverage[point])) or ["every configuration"]
            raise SystemExit(f"pilot coverage: grid point eta={point[0]:g}, lambda={point[1]:g} lacks "
                             f"{', '.join(missing)}")
    smallest = {point: min(coverage[point].values()) for point in order}
    covering = [point for point in order if smallest[point] >= target - 1e-12]
    chosen = covering[0] if covering else max(order, key=lambda p: (smallest[p], -order.index(p)))
    return {"head_attention_share": chosen[0], "tail_mix": chosen[1], "covers": bool(covering),
            "smallest_coverage": round(float(smallest[chosen]), 4)}


def _resize_script():
    """workflow/scripts/resize_design.py as a module: the plan's cells (its registered plan methods)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("amendment_resize_design", Path(__file__).with_name("resize_design.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def defense_pilot_spec(doc: dict) -> dict:
    """The plan of the pilot's cells: the amendment's plan (scorers, allocators, budgets) at pilot.share, crossed with
    pilot.grid, Poisson seeds pilot.poisson_seeds."""
    pilot, plan = doc["pilot"], doc["plan"]
    grid = pilot["grid"]
    labels = {f["override"].removeprefix("design_options."): f["label"] for f in plan["factors"]}
    factors = [{"override": "design_options.head_fraction", "label": labels.get("head_fraction", "share"),
                "values": [pilot["share"]]}]
    factors += [{"override": f"design_options.{d}", "label": labels.get(d, d), "values": list(grid[d])}
                for d in reversed(DEFENSES)]
    return {**plan, "factors": factors, "poisson_seeds": list(pilot["poisson_seeds"])}


def defense_pilot_cells(doc: dict, population: dict) -> dict[str, dict]:
    """{cell name: {model, kind, shards, overrides}} of the pilot: the oracle cells of the plan's cell method over
    ``defense_pilot_spec``, pilot.n_items items each (data seed pilot.items_seed)."""
    resize = _resize_script()
    spec = defense_pilot_spec(doc)
    plan = methods("plan")[spec["method"]]
    n, seed = int(doc["pilot"]["n_items"]), int(doc["pilot"]["items_seed"])
    counts = {f"{kind}-{m}": n for m in population["models"] for kind in resize.KINDS}
    cells = plan(population, counts, {kind: seed for kind in resize.KINDS}, spec)
    return {name: cell for name, cell in cells.items() if cell.get("kind") == "oracle"}


def defense_pilot_cost(doc: dict, cells: dict[str, dict], root: Path) -> dict:
    """The pilot's cost before it runs, from measured times (pilot.cost_from, a timing.yaml whose cells ran the plan's
    Poisson seeds at pilot.share without defenses): a pilot cell costs its undefended cell's seconds per item, times
    its share of the Poisson seeds. Returns cell-seconds and wall minutes at power.timing.cores cells at a time."""
    import re

    pilot = doc["pilot"]
    timing = yaml.safe_load((root / pilot["cost_from"]).read_text())["measured"]
    seeds = len(pilot["poisson_seeds"]) / len(doc["plan"]["poisson_seeds"])
    labels = "|".join(re.escape(str(f["label"])) for f in doc["plan"]["factors"][1:])
    per_item = {}
    for name in cells:
        measured_as = re.sub(rf"-({labels})[0-9.]+", "", name) if labels else name
        if measured_as not in timing:
            raise SystemExit(f"{pilot['cost_from']}: no measured time for {measured_as} (pilot cell {name})")
        per_item[name] = float(timing[measured_as]["per_item_median"]) * seeds
    total = sum(per_item.values()) * int(pilot["n_items"])
    cores = int(doc["power"]["timing"]["cores"])
    return {"cells": len(cells), "items_per_cell": int(pilot["n_items"]), "cell_seconds": round(total),
            "cores": cores, "wall_minutes": round(total / cores / 60, 1)}


def pilot_coverage(cells: Path, names: list[str], delta: float) -> dict[tuple[float, float], dict[str, float]]:
    """{(eta, lambda): {"scorer,allocator": coverage}} from the pilot cells' steps tables: the share of Poisson step
    rows (finite true and estimated error) whose true attention-output error is at most the certificate
    sqrt(trace_var / delta), rows pooled over the cells' models, items, budgets and seeds (C3's estimator)."""
    import numpy as np
    import pandas as pd

    counts: dict[tuple, list[float]] = {}
    for name in names:
        path = cells / name / "shard-0" / "steps.parquet"
        try:
            steps = pd.read_parquet(path)
        except Exception as error:  # a missing or unreadable table, named
            raise SystemExit(f"{path}: unreadable ({type(error).__name__})") from None
        for column in ("policy", "design", "true_err", "trace_var"):
            if column not in steps.columns:
                raise SystemExit(f"{path}: no column {column}")
        rows = steps[steps["design"] == "poisson"]
        err, var = rows["true_err"].to_numpy(float), rows["trace_var"].to_numpy(float)
        ok = np.isfinite(err) & np.isfinite(var)
        covered = err <= np.sqrt(np.where(ok, var, 0.0) / delta)
        allocator = (rows["allocator"].fillna("uniform").astype(str) if "allocator" in rows.columns
                     else pd.Series("uniform", index=rows.index))
        point = tuple(float(rows[d].iloc[0]) if d in rows.columns and len(rows) else 0.0 for d in DEFENSES)
        for (policy, alloc), index in pd.DataFrame({"p": rows["policy"].astype(str), "a": allocator}).groupby(
                ["p", "a"]).indices.items():
            found = counts.setdefault((point, f"{policy},{alloc}"), [0.0, 0.0])
            found[0] += float(covered[index][ok[index]].sum())
            found[1] += float(ok[index].sum())
    out: dict[tuple[float, float], dict[str, float]] = {}
    for (point, configuration), (hit, n) in sorted(counts.items()):
        if n:
            out.setdefault(point, {})[configuration] = hit / n
    return out


@register_method("pilot", "smallest_defense_covering", steps="whole", estimates=True)
def smallest_defense_covering(args, pilot: dict) -> None:
    """Amendment 6's method: the reused population (pilot.population_from) plus the defense the pilot chose
    (``chosen``: eta and lambda by ``smallest_covering``) and the pilot's coverage table (``defense_pilot``)."""
    from kvcert.analysis import prereg
    from kvcert.scales import cell_overrides

    doc = amendment_data(args.amendment)
    root = prereg.find_root(Path(args.amendment).resolve().parent)
    population = reused_population(args.amendment, pilot)
    cells = defense_pilot_cells(doc, population)
    cost = defense_pilot_cost(doc, cells, root)
    print(f"pilot: {cost['cells']} oracle cells x {cost['items_per_cell']} items, estimated {cost['cell_seconds']} "
          f"cell-seconds, about {cost['wall_minutes']} minutes on {cost['cores']} cores", file=sys.stderr, flush=True)
    if args.estimate:
        return
    if args.cells is None:
        raise SystemExit(f"--method {args.method}: needs --cells (the folder of the pilot's cells)")
    run_cells(dict(sorted(cells.items())), args.cells, cost["cores"])
    delta = float(prereg.load_claims(root)["conventions"]["delta"])
    coverage = pilot_coverage(args.cells, sorted(cells), delta)
    chosen = smallest_covering(coverage, float(pilot["target"]))
    table = [{"head_attention_share": eta, "tail_mix": lam, **{c: round(v, 4) for c, v in sorted(row.items())}}
             for (eta, lam), row in sorted(coverage.items())]
    out = {**population, "chosen": chosen,
           "defense_pilot": {"rule": shown_path(args.amendment) + ": pilot", "share": pilot["share"],
                             "target": pilot["target"], "items_seed": pilot["items_seed"],
                             "items_per_model": pilot["n_items"], "estimated": cost, "coverage": table}}
    write_text_atomic(yaml.safe_dump(out, sort_keys=False, width=110), args.out)


def run_cells(cells: dict[str, dict], out_dir: Path, cores: int, what: str = "pilot") -> None:
    """Every cell ({name: {model, overrides}}) through kvcert-run, in the order given, one thread each, ``cores`` at a
    time, into ``out_dir/<name>/shard-0``; a cell whose manifest exists is kept (a rerun resumes). Progress: one bar
    over the cells. ``what`` names them in the bar and in the one-line error of a cell that fails (the pilot's cells
    here, the timing cells in resize_design.py)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    command = str(Path(sys.executable).with_name("kvcert-run"))

    def run(item):
        name, cell = item
        target = Path(out_dir) / name / "shard-0"
        if (target / "manifest.json").is_file():
            return
        done = subprocess.run([command, f"model={cell['model']}", *cell["overrides"], "threads=1", "progress=false",
                               f"out_dir={target}"], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{what} cell {name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=cores) as pool:
        for _ in tqdm(pool.map(run, cells.items()), total=len(cells), desc=f"{what} cells", file=sys.stderr):
            pass


# The pilot methods, by the name a version's data gives (kvcert.analysis.prereg.Version.pilot), as registered above
# (kvcert.analysis.registry, kind "pilot"): `threshold` (variants in order until one passes a threshold), `staged`
# (stages A-D) and `reuse_population` (a locked population, no stage). A new pilot rule is one more registered
# function.
PILOTS = methods("pilot")
# How workflow/rules/design.smk obtains an amendment's population.yaml from each method (its ``steps``):
# `per_model` runs the method once per model (pilot-<model>.csv) and then `choose` (pilot.csv and population.yaml);
# `whole` writes population.yaml in one step and no pilot rows. A method without steps (threshold: amendment 2 chose
# its population by hand) is not run by the workflow.
POPULATION_STEPS = {name: fn.steps for name, fn in PILOTS.items() if getattr(fn, "steps", None)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["choose"]:
        return choose_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", required=True, choices=sorted(PILOTS),
                        help="the amendment's pilot method, as its data names it (preregistration/versions.yaml "
                             "or its amendment.yaml's pilot.method)")
    parser.add_argument("--amendment", type=Path, required=True)
    parser.add_argument("--model", help="a bundled model name (smollm2, gemma3) or model spec (every method but "
                        "reuse_population, which runs no model)")
    parser.add_argument("--out", type=Path, help="the method's output (every method; not with --estimate)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--round", type=int, default=1, help="threshold: 2 runs the variants of pilot.round_2")
    parser.add_argument("--smoke", action="store_true", help="staged: 2 items of one variant, bands open")
    parser.add_argument("--cells", type=Path, help="smallest_defense_covering: the folder of the pilot's cells")
    parser.add_argument("--estimate", action="store_true",
                        help="smallest_defense_covering: print the pilot's estimated cost and run nothing")
    args = parser.parse_args(argv)
    if args.model is None and POPULATION_STEPS.get(args.method) != "whole":
        parser.error(f"--method {args.method} needs --model")
    if args.estimate and not getattr(PILOTS[args.method], "estimates", False):
        parser.error(f"--estimate: pilot method {args.method} runs no cells to estimate")
    if args.out is None and not args.estimate:
        parser.error("--out is required (but with --estimate)")
    PILOTS[args.method](args, amendment_data(args.amendment)["pilot"])
    return 0


def choose_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="apply a staged pilot's rules to its rows")
    parser.add_argument("--amendment", type=Path, required=True)
    parser.add_argument("--pilot", type=Path, nargs="+", required=True, help="the per-model pilot CSV files")
    parser.add_argument("--csv", type=Path, required=True, help="all rows, one file (the amendment's pilot.csv)")
    parser.add_argument("--out", type=Path, required=True, help="the population (YAML)")
    args = parser.parse_args(argv)
    pilot = amendment_data(args.amendment)["pilot"]
    rows = read_rows(args.pilot)
    models = list(dict.fromkeys(r["model"] for r in rows))
    missing = [m for m in pilot["models"] if m not in models]
    if missing:
        raise SystemExit(f"{', '.join(map(str, args.pilot))}: no rows of model(s) {', '.join(missing)}")
    doc = {"rules": shown_path(args.amendment), "items_seed": pilot["items_seed"], **population(rows, pilot, pilot["models"])}
    write_text_atomic(_csv(rows, COLUMNS_4), args.csv)
    write_text_atomic(yaml.safe_dump(doc, sort_keys=False, width=110), args.out)
    print(yaml.safe_dump(doc, sort_keys=False, width=110), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The power analysis of a pre-registration amendment, from committed studies' bootstrap intervals.

    python workflow/scripts/power.py --method version_1_span --v1-claims results/v1/claims --n-qa 700 --n-streaming 600
    python workflow/scripts/power.py --method studies_span_targets --amendment preregistration/amendment-4.yaml \
        --studies v1=results/v1/claims v2=results/v2/claims v2-full=results/v2-full/claims v3=results/v3/claims \
        --pilot preregistration/amendment-4/pilot.csv --population preregistration/amendment-4/population.yaml

For each tested component of version 1 (and the C4-C7 secondary intervals), the per-item standard deviation
implied by its 95% percentile interval, sd = width * sqrt(n) / (2 * 1.96), the number of items that makes
the interval span at most ``--span`` (the C1/C2 target, 4 points), and the width expected at the planned
item counts (question-aware items for C1-C5, streaming items for C6-C7). Prints YAML for the amendment.
Uses version 1's variances only, never its verdicts.

Method ``studies_span_targets`` (amendment 4's; ``version_1_span`` is the one above, amendments 2 and 3's): the
largest per-item sd over every C1 and C2 component of every named study gives the question-aware items for a 4-point span, the same over C7's components the streaming items for C7; C6's
items come from the largest k = width^2 / (1/n_inherent + 1/n_cache_induced) over the studies and the pilot's
stage-D class rates (the amendment's power rule, stated there in words).

Method ``per_component_span`` (amendment 5's; its power.rule states it in words, its data in power.span_targets):
C2, the largest per-item sd over every C2 component of every named study, n_c2 = ceil((2 * 1.96 * sd_max / span)^2)
question-aware items per component (span: c2_points, 4 for amendment 5); C3, the largest per-item sd of coverage
and of Spearman over the studies, n_c3 the larger of their items for the c3_spans (0.02 and 0.05), with a floor of
oracle_floor_per_model (8) oracle items per model; C6 and C7, the amendment's powered streaming items and C6's
floor as the amended version's locked power.yaml and design.yaml state them; items split equally between the
models (per model: ceil(n / models)).

    python workflow/scripts/power.py --method per_component_span --amendment preregistration/amendment-5/amendment.yaml \
        --studies v1=results/v1/claims ... v4-full=results/v4-full/claims --out preregistration/amendment-5/power.yaml
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import yaml

from kvcert.analysis.registry import methods, register_method

Z = 1.959964
SETTING = {"c1": "question_aware", "c2": "question_aware", "c3": "question_aware", "c4": "question_aware",
           "c5": "question_aware", "c6": "streaming", "c7": "streaming"}
SECONDARY = {"c4": ["auc_certificate", "auc_confidence"], "c5": ["gain_over_random"],
             "c6": ["auc_certificate", "auc_confidence"], "c7": ["gain_over_random", "gain_over_confidence"]}


@functools.cache
def _pilot():
    """workflow/scripts/pilot.py as a module: its row reader and its way of stating paths in committed files."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pilot", Path(__file__).with_name("pilot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sd_of(low: float, high: float, n: int) -> float:
    return (high - low) * math.sqrt(n) / (2 * Z)


def analysis(claims_dir: Path, span: float, n_qa: int, n_streaming: int) -> dict:
    out = {"formula": "sd = width * sqrt(n) / (2 * 1.96); n_for_span = (2 * 1.96 * sd / span)^2; "
                      "expected width at n = 2 * 1.96 * sd / sqrt(n)",
           "span_target_points": span, "planned_items": {"question_aware": n_qa, "streaming": n_streaming},
           "components": {}}
    for claim in ("c1", "c2", "c4", "c5", "c6", "c7"):
        result = json.loads((claims_dir / f"{claim}.json").read_text())
        n = int(result["n"])
        planned = n_qa if SETTING[claim] == "question_aware" else n_streaming
        entries = [(c["name"], c["ci_low"], c["ci_high"]) for c in result["details"]["components"]]
        entries += [(name, result["details"][name]["ci_low"], result["details"][name]["ci_high"])
                    for name in SECONDARY.get(claim, []) if name in result["details"]
                    and name not in [e[0] for e in entries]]
        for name, low, high in entries:
            sd = sd_of(low, high, n)
            row = {"version_1_interval": [round(low, 4), round(high, 4)], "version_1_items": n, "sd_per_item": round(sd, 4),
                   "expected_width_at_plan": round(2 * Z * sd / math.sqrt(planned), 4)}
            if claim in ("c1", "c2"):
                row["items_for_span"] = math.ceil((2 * Z * sd / span) ** 2)
            out["components"][f"{claim}.{name}"] = row
    binding = [v["items_for_span"] for v in out["components"].values() if "items_for_span" in v]
    out["items_for_span_c1_c2"] = max(binding)
    return out


# --- amendment 4: every committed study's variances, and the pilot's class rates for C6 -------------------------


def _components(result: dict) -> list[tuple[str, float, float]]:
    return [(c["name"], c["ci_low"], c["ci_high"]) for c in result["details"]["components"]]


def items_for_span(claims_dirs: dict[str, Path], claim_ids: tuple[str, ...], span: float) -> dict:
    """The largest per-item sd over every component of ``claim_ids`` in every study, and the items that make
    an interval of that sd span ``span``: n = ceil((2 * 1.96 * sd_max / span)^2)."""
    sds = {}
    for study, claims_dir in claims_dirs.items():
        for claim in claim_ids:
            result = json.loads((claims_dir / f"{claim}.json").read_text())
            for name, low, high in _components(result):
                sds[f"{study} {claim}.{name}"] = round(sd_of(low, high, int(result["n"])), 4)
    binding = max(sds, key=sds.get)
    return {"sd_per_item": sds, "sd_max": sds[binding], "sd_max_from": binding,
            "items": math.ceil((2 * Z * sds[binding] / span) ** 2)}


def c6_constant(claims_dirs: dict[str, Path]) -> dict:
    """k = width(auc_certificate)^2 / (1/n_inherent + 1/n_cache_induced) per study, and the largest."""
    ks = {}
    for study, claims_dir in claims_dirs.items():
        details = json.loads((claims_dir / "c6.json").read_text())["details"]
        low, high = details["auc_certificate"]["ci_low"], details["auc_certificate"]["ci_high"]
        n_inh, n_cache = int(details["n_inherent"]), int(details["n_cache_induced"])
        ks[study] = {"width": round(high - low, 4), "n_inherent": n_inh, "n_cache_induced": n_cache,
                     "k": round((high - low) ** 2 / (1 / n_inh + 1 / n_cache), 4)}
    binding = max(ks, key=lambda s: ks[s]["k"])
    return {"by_study": ks, "k_max": ks[binding]["k"], "k_max_from": binding}


def class_rates(rows: list[dict], population: dict) -> dict:
    """Per run at Poisson 25% in the streaming setting (pilot stage D), the fractions failing where the full
    cache fails too (p_inh) and where it answers (p_cache), over the streaming population's (model, task) pairs,
    each weighted equally."""
    pairs = [(model, v["label"]) for model, m in population["models"].items() for v in m["streaming"]]
    per_pair = {}
    for model, task in pairs:
        found = [r for r in rows if r["model"] == model and r["task"] == task and r["stage"] == "D"
                 and r["design"] == "poisson"]
        if not found:
            raise SystemExit(f"pilot rows: no stage-D Poisson row for {model} {task}")
        r = found[0]
        per_pair[f"{model} {task}"] = {"p_inh": r["n_fail_inherent"] / r["n_runs"], "p_cache": r["n_fail_cache"] / r["n_runs"]}
    return {"by_task": per_pair,
            "p_inh": sum(v["p_inh"] for v in per_pair.values()) / len(per_pair),
            "p_cache": sum(v["p_cache"] for v in per_pair.values()) / len(per_pair)}


def items_for_c6(k_max: float, p_inh: float, p_cache: float, width: float, min_runs: int, runs_per_item: int = 3) -> int:
    """The smallest n with sqrt(k_max * (1/(r n p_inh) + 1/(r n p_cache))) <= width and r n min(p) >= min_runs."""
    if min(p_inh, p_cache) <= 0:
        raise SystemExit(f"C6 cannot be sized: a class never occurs in the pilot (p_inh={p_inh}, p_cache={p_cache})")
    by_width = k_max * (1 / p_inh + 1 / p_cache) / (runs_per_item * width ** 2)
    by_count = min_runs / (runs_per_item * min(p_inh, p_cache))
    return math.ceil(max(by_width, by_count) - 1e-9)


def amendment4(claims_dirs: dict[str, Path], rows: list[dict], population: dict, targets: dict) -> dict:
    c1_c2 = items_for_span(claims_dirs, ("c1", "c2"), float(targets["c1_c2_points"]))
    c7 = items_for_span(claims_dirs, ("c7",), float(targets["c7_points"]))
    k = c6_constant(claims_dirs)
    rates = class_rates(rows, population)
    n_c6 = items_for_c6(k["k_max"], rates["p_inh"], rates["p_cache"], float(targets["c6_auc"]),
                        int(targets["c6_design_runs_per_class"]))
    n_streaming = max(n_c6, c7["items"])
    return {"formula": "sd = width * sqrt(n) / (2 * 1.96); n_for_span = ceil((2 * 1.96 * sd_max / span)^2); "
                       "C6: k = width^2 / (1/n_inherent + 1/n_cache_induced), n_c6 = smallest n with "
                       "sqrt(k_max (1/(3 n p_inh) + 1/(3 n p_cache))) <= width target and 3 n min(p) >= runs target",
            "studies": {s: _pilot().shown_path(d) for s, d in claims_dirs.items()}, "targets": targets,
            "c1_c2": c1_c2, "c7": c7, "c6": {**k, **rates, "items": n_c6},
            "question_aware_items": c1_c2["items"], "streaming_items": n_streaming,
            "per_model": {"question_aware": math.ceil(c1_c2["items"] / len(population["models"])),
                          "streaming": math.ceil(n_streaming / len(population["models"]))}}


@register_method("power", "version_1_span")
def version_1_span(args, parser) -> str:
    """Amendments 2 and 3's method: version 1's variances at planned item counts."""
    if args.v1_claims is None or args.n_qa is None or args.n_streaming is None:
        parser.error("--method version_1_span needs --v1-claims, --n-qa and --n-streaming")
    return yaml.safe_dump(analysis(args.v1_claims, args.span, args.n_qa, args.n_streaming), sort_keys=False, width=110)


@register_method("power", "studies_span_targets")
def studies_span_targets(args, parser) -> str:
    """Amendment 4's method: every named study's variances, the amendment's span targets and the pilot's class rates."""
    missing = [f"--{k}" for k in ("amendment", "pilot", "population") if getattr(args, k) is None]
    if missing or not args.studies:
        missing += [] if args.studies else ["--studies"]
        parser.error(f"--method studies_span_targets needs {', '.join(missing)}")
    pilot = _pilot()
    targets = pilot.amendment_data(args.amendment)["power"]["span_targets"]
    studies = dict(item.split("=", 1) for item in args.studies)
    doc = amendment4({s: Path(d) for s, d in studies.items()}, pilot.read_rows([args.pilot]),
                     yaml.safe_load(args.population.read_text()), targets)
    return yaml.safe_dump(doc, sort_keys=False, width=110)


# --- amendment 5: a span per component, from every committed study's C2 and C3 intervals -------------------------

# The rule's numbers are the amendment's data (power.span_targets: c2_points, c3_spans, oracle_floor_per_model);
# amendment 5's locked document states them in words (power.rule) and its sidecar as data.
SPAN_TARGET_KEYS = ("c2_points", "c3_spans", "oracle_floor_per_model")


def c3_items(claims_dirs: dict[str, Path], spans: dict[str, float]) -> dict:
    """Per C3 component (coverage, spearman): the largest per-item sd over the studies and the items for its span;
    ``items`` is the larger of the two. A study decided per configuration (components coverage[scorer,allocator,
    share], ...) gives its largest sd over its configurations."""
    out = {}
    for name, span in spans.items():
        sds = {}
        for study, claims_dir in claims_dirs.items():
            result = json.loads((claims_dir / "c3.json").read_text())
            found = [(low, high) for n_, low, high in _components(result) if n_ == name or n_.startswith(f"{name}[")]
            if not found:
                raise SystemExit(f"{claims_dir / 'c3.json'}: no component {name!r}")
            sds[study] = round(max(sd_of(low, high, int(result["n"])) for low, high in found), 4)
        binding = max(sds, key=sds.get)
        out[name] = {"sd_per_item": sds, "sd_max": sds[binding], "sd_max_from": binding, "span": span,
                     "items": math.ceil((2 * Z * sds[binding] / span) ** 2)}
    return {**out, "items": max(v["items"] for v in out.values())}


def amended_streaming(document: Path) -> dict:
    """C6 and C7 as the amended version (``amends.version``) sized them: its locked power.yaml's streaming items
    per model and its design.yaml's C6 floor (pooled streaming items), or, where the amended version used this
    method too, what its power.yaml carried forward (``c6_c7``)."""
    from kvcert.analysis import prereg

    doc = yaml.safe_load(Path(document).read_text())
    root = prereg.find_root(Path(document).resolve().parent)
    amended = prereg.version(int(doc["amends"]["version"]), root)
    power = yaml.safe_load((root / amended.folder / "power.yaml").read_text())
    if isinstance(power.get("c6_c7"), dict):  # the amended version carried them forward itself (this method's output)
        carried = power["c6_c7"]
        return {"from": [f"{amended.folder}/power.yaml"], **{k: carried[k] for k in (
            "streaming_items_per_model", "streaming_items", "c6_floor_items")}}
    design = yaml.safe_load((root / amended.folder / "design.yaml").read_text())
    return {"from": [f"{amended.folder}/power.yaml", f"{amended.folder}/design.yaml"],
            "streaming_items_per_model": int(power["per_model"]["streaming"]),
            "streaming_items": int(power["streaming_items"]),
            "c6_floor_items": int(design["c6_min_streaming_items"])}


def per_component(claims_dirs: dict[str, Path], models: list[str], streaming: dict, targets: dict) -> dict:
    """Amendment 5's power.yaml: n_c2, n_c3 and the amended version's streaming sizes, pooled and per model.
    targets: the amendment's power.span_targets (c2_points, c3_spans {coverage, spearman}, oracle_floor_per_model)."""
    c2_span = float(targets["c2_points"])
    c2 = items_for_span(claims_dirs, ("c2",), c2_span)
    c3 = c3_items(claims_dirs, {k: float(v) for k, v in targets["c3_spans"].items()})
    per = len(models)
    per_model = {"question_aware": math.ceil(c2["items"] / per),
                 "oracle": max(int(targets["oracle_floor_per_model"]), math.ceil(c3["items"] / per)),
                 "streaming": streaming["streaming_items_per_model"],
                 "streaming_c6_floor": math.ceil(streaming["c6_floor_items"] / per)}
    return {"formula": "sd = width * sqrt(n) / (2 * 1.96); n = ceil((2 * 1.96 * sd_max / span)^2); C2 span 4 points; "
                       "C3 spans 0.02 (coverage) and 0.05 (spearman), at least 8 oracle items per model; per model "
                       "ceil(n / models)",
            "studies": {s: _pilot().shown_path(d) for s, d in claims_dirs.items()}, "models": models,
            "c2": {**c2, "span": c2_span}, "c3": c3, "c6_c7": streaming,
            "question_aware_items": per_model["question_aware"] * per, "oracle_items": per_model["oracle"] * per,
            "streaming_items": per_model["streaming"] * per, "per_model": per_model}


@register_method("power", "per_component_span")
def per_component_span(args, parser) -> str:
    """Amendment 5's method: every named study's C2 and C3 variances; C6 and C7 as the amended version sized them."""
    if args.amendment is None or not args.studies:
        parser.error("--method per_component_span needs --amendment and --studies")
    doc = _pilot().amendment_data(args.amendment)
    named = list(doc["power"].get("studies") or [])
    studies = dict(item.split("=", 1) for item in args.studies)
    if named and list(studies) != named:
        parser.error(f"--studies {' '.join(studies)}: the amendment's power.studies are {' '.join(named)}")
    targets = doc["power"].get("span_targets")
    missing = [k for k in SPAN_TARGET_KEYS if not isinstance(targets, dict) or k not in targets]
    if missing:
        raise SystemExit(f"{_pilot().shown_path(args.amendment)}: power.span_targets lacks {', '.join(missing)}")
    out = per_component({s: Path(d) for s, d in studies.items()}, list(doc["pilot"]["models"]),
                        amended_streaming(args.amendment), targets)
    return yaml.safe_dump(out, sort_keys=False, width=110)


# The power methods, by the name a version's data gives (kvcert.analysis.prereg.Version.power), as registered above
# (kvcert.analysis.registry, kind "power"); a new power rule is one more registered function.
METHODS = methods("power")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", required=True, choices=sorted(METHODS),
                        help="the amendment's power method, as its data names it")
    parser.add_argument("--v1-claims", type=Path, help="version_1_span: version 1's claims folder")
    parser.add_argument("--span", type=float, default=4.0)
    parser.add_argument("--n-qa", type=int)
    parser.add_argument("--n-streaming", type=int)
    parser.add_argument("--amendment", type=Path, help="studies_span_targets: its document (power.span_targets)")
    parser.add_argument("--studies", nargs="+", default=[],
                        help="studies_span_targets: STUDY=CLAIMS_DIR of committed studies")
    parser.add_argument("--pilot", type=Path, help="studies_span_targets: the pilot's rows (pilot.csv)")
    parser.add_argument("--population", type=Path, help="studies_span_targets: the chosen population (population.yaml)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = METHODS[args.method](args, parser)
    if args.out:
        from kvcert.atomic import write_text_atomic

        write_text_atomic(text, args.out)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

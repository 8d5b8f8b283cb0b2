"""Amendment 4's pilot rules (workflow/scripts/pilot.py), applied to made-up pilot rows: every number here is
invented to exercise a rule, none comes from a pilot run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "workflow" / "scripts" / "pilot.py"


@pytest.fixture(scope="module")
def pilot_script():
    spec = importlib.util.spec_from_file_location("pilot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rules():
    return yaml.safe_load((ROOT / "preregistration" / "amendment-4.yaml").read_text())["pilot"]


def _a(model, family, task, accuracy):
    return {"model": model, "stage": "A", "family": family, "task": task, "design": "full", "window": None,
            "kernel": None, "accuracy": accuracy, "n_runs": 40}


def _b(model, task, window, kernel, accuracy):
    return {"model": model, "stage": "B", "family": "-", "task": task, "design": "topk", "window": window,
            "kernel": kernel, "accuracy": accuracy, "n_runs": 30}


def _cd(model, task, topk, poisson, stream_full, stream_poisson):
    return [{"model": model, "stage": "C", "task": task, "design": "topk", "accuracy": topk, "n_runs": 30},
            {"model": model, "stage": "C", "task": task, "design": "poisson", "accuracy": poisson, "n_runs": 90},
            {"model": model, "stage": "D", "task": task, "design": "full", "accuracy": stream_full, "n_runs": 30},
            {"model": model, "stage": "D", "task": task, "design": "poisson", "accuracy": stream_poisson, "n_runs": 90}]


def _grid(model, task, rules, best=None, value=0.5, top=0.8):
    return [_b(model, task, w, k, top if (w, k) == best else value)
            for w in rules["stage_b"]["windows"] for k in rules["stage_b"]["kernels"]]


def test_the_amendment_states_every_rule_the_script_reads(rules, pilot_script):
    assert rules["items_seed"] == 9401
    assert rules["stage_a"]["band"] == [0.55, 0.90] and rules["stage_d"]["band"] == [0.30, 0.80]
    assert rules["stage_c"]["band"] == [0.30, None]
    assert pilot_script.tie_order(rules)[:3] == [(16, 5), (8, 1), (8, 5)]
    assert len(pilot_script.tie_order(rules)) == 12
    assert list(rules["families"]) == ["retrieval", "multi_hop_tracing", "aggregation"]
    labels = [pilot_script._label(v) for _, v in pilot_script.variants_in_order(rules)]
    assert len(labels) == len(set(labels))  # a label names one variant
    assert all("context_tokens" in v for _, v in pilot_script.variants_in_order(rules))


def test_bands_choose_the_first_variant_in_order_and_the_best_pair(rules, pilot_script):
    rows = [_a("m", "retrieval", "niah_multikey_4", 0.50),      # below the band
            _a("m", "retrieval", "niah_multikey_2", 0.70),      # first in band: stage B task
            _a("m", "retrieval", "niah_single", 0.95),          # above
            _a("m", "multi_hop_tracing", "vt_2", 0.0),
            _a("m", "multi_hop_tracing", "vt_1", 0.60),
            _a("m", "aggregation", "cwe_5", 0.10)]
    assert pilot_script.stage_b_tasks(rows, "m", rules) == [("retrieval", "niah_multikey_2"), ("multi_hop_tracing", "vt_1")]
    rows += _grid("m", "niah_multikey_2", rules, best=(32, 9)) + _grid("m", "vt_1", rules, best=(32, 9))
    assert pilot_script.choose_pair(rows, "m", rules) == (32, 9)
    # niah_multikey_2: question-aware 25% keeps (0.2 + 3 * 0.2) / 4 / 0.7 = 0.29 < 0.30: fails stage C;
    # its streaming ratio 0.2 / 0.7 is in band. vt_1: stage C 0.45 / 0.6 passes; streaming 0.55 / 0.6 > 0.80 fails.
    rows += _cd("m", "niah_multikey_2", 0.2, 0.2, 0.7, 0.2) + _cd("m", "vt_1", 0.45, 0.45, 0.6, 0.55)
    pop = pilot_script.population(rows, rules, ["m"])
    chosen = pop["models"]["m"]
    assert (chosen["window"], chosen["kernel"]) == (32, 9)
    assert [v["label"] for v in chosen["question_aware"]] == ["vt_1"]
    assert [v["label"] for v in chosen["streaming"]] == ["niah_multikey_2"]
    assert pop["families"] == ["retrieval", "multi_hop_tracing"]
    assert any("aggregation variant in the full-cache band" in d for d in pop["deviations"])
    assert any("2 of 3 families" in d for d in pop["deviations"])


def test_ties_keep_the_records_pair_and_deviations_are_mechanical(rules, pilot_script):
    rows = [_a("m", "retrieval", "niah_multikey_2", 0.97), _a("m", "retrieval", "niah_single", 1.0),
            _a("m", "multi_hop_tracing", "vt_1", 0.0)]
    rows += _grid("m", "niah_multikey_2", rules, value=0.6)  # every pair ties
    assert pilot_script.choose_pair(rows, "m", rules) == (16, 5)
    assert pilot_script.choose_pair([], "m", rules) == (16, 5)
    pop = pilot_script.population(rows, rules, ["m"])
    chosen = pop["models"]["m"]
    # Nothing in band: the nearest variant to [0.55, 0.90] is niah_multikey_2 (0.07 above), and with no
    # in-band variant the streaming setting takes the question-aware task.
    assert [v["label"] for v in chosen["question_aware"]] == ["niah_multikey_2"]
    assert [v["label"] for v in chosen["streaming"]] == ["niah_multikey_2"]
    assert any("rule 2" in d and "niah_multikey_2" in d for d in pop["deviations"])
    assert any("rule 3" in d for d in pop["deviations"])


def test_choose_writes_the_rows_and_the_population(tmp_path, rules, pilot_script):
    header = ",".join(pilot_script.COLUMNS_4)
    lines = [header,
             "smollm2,A,retrieval,niah_multikey_2,1024,,,question_aware,full,1.0,40,40,28,0.7,False,7.1,,",
             "gemma3,A,retrieval,niah_multikey_2,1024,,,question_aware,full,1.0,40,40,30,0.75,False,8.0,,"]
    src = tmp_path / "rows.csv"
    src.write_text("\n".join(lines) + "\n")
    amendment = ROOT / "preregistration" / "amendment-4.yaml"
    assert pilot_script.main(["choose", "--amendment", str(amendment), "--pilot", str(src), "--csv",
                              str(tmp_path / "pilot.csv"), "--out", str(tmp_path / "population.yaml")]) == 0
    pop = yaml.safe_load((tmp_path / "population.yaml").read_text())
    assert set(pop["models"]) == {"smollm2", "gemma3"} and pop["items_seed"] == 9401
    assert (tmp_path / "pilot.csv").read_text().splitlines() == lines
    with pytest.raises(SystemExit, match="no rows of model"):
        src.write_text("\n".join(lines[:2]) + "\n")
        pilot_script.main(["choose", "--amendment", str(amendment), "--pilot", str(src), "--csv",
                           str(tmp_path / "p.csv"), "--out", str(tmp_path / "q.yaml")])


class _Item:
    def __init__(self, task, index):
        self.id, self.task, self.index = f"{task}/{index}", task, index


def _fake_runner(pilot_script, rules, calls):
    """A Runner whose outcomes are a fixed function of (task, item, configuration): no model."""
    acc = {"niah_multikey_2": 0.7, "vt_1": 0.6, "cwe_2": 0.75}  # in band; every other variant answers nothing

    class Fake(pilot_script.Runner):
        def __init__(self):
            self.name, self.pilot = "fake", rules

        def items(self, variant, n):
            return [_Item(pilot_script._label(variant), i) for i in range(n)]

        def outcomes(self, item, setting, configs, window=16, kernels=(5,)):
            calls.append((item.task, setting, window))
            p = acc.get(item.task, 0.0)
            full = (item.index * 7919 % 100) / 100 < p
            out = {}
            for kernel in kernels:
                for design, budget, seed in configs:
                    if design == "full":
                        out[(None, "full", 1.0, 0)] = full
                    else:
                        kept = (item.index + seed + window + kernel) % 3 != 0 if setting == "question_aware" else \
                            (item.index + seed) % 2 == 0
                        out[(kernel, design, budget, seed)] = full and kept
            return out

    return Fake()


def test_the_stages_run_in_order_and_a_rerun_resumes_from_the_saved_rows(tmp_path, rules, pilot_script):
    calls = []
    out = tmp_path / "pilot-fake.csv"
    rows = pilot_script.pilot_staged(_fake_runner(pilot_script, rules, calls), out)
    assert out.is_file() and not out.with_name(out.name + ".partial").exists()
    stages = [r["stage"] for r in rows]
    assert stages == sorted(stages, key=lambda st: st.replace("D", "C"))  # A, then B, then C and D per variant
    assert {r["task"] for r in rows if r["stage"] == "B"} == {"niah_multikey_2", "vt_1", "cwe_2"}
    assert len([r for r in rows if r["stage"] == "B"]) == 3 * 12
    assert {(r["stage"], r["design"]) for r in rows if r["stage"] in "CD"} == {
        ("C", "topk"), ("C", "poisson"), ("D", "full"), ("D", "poisson")}
    d = next(r for r in rows if r["stage"] == "D" and r["design"] == "poisson" and r["task"] == "vt_1")
    assert d["n_fail_inherent"] + d["n_fail_cache"] == d["n_runs"] - d["n_correct"]
    # Interrupted after stage A: the rerun recomputes stages B-D only and writes the same rows.
    partial = out.with_name(out.name + ".partial")
    partial.write_text(pilot_script._csv([r for r in rows if r["stage"] == "A"], pilot_script.COLUMNS_4))
    first = len(calls)
    calls.clear()
    again = pilot_script.pilot_staged(_fake_runner(pilot_script, rules, calls), tmp_path / "pilot-fake.csv")
    assert pilot_script._csv(again, pilot_script.COLUMNS_4) == out.read_text()
    assert len(calls) == first - sum(r["n_items"] for r in rows if r["stage"] == "A")  # stage A was not rerun
    assert {task for task, _, _ in calls} == {"niah_multikey_2", "vt_1", "cwe_2"}

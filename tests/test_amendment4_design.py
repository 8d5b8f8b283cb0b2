"""Amendment 4's sizing tools: the power rule on the committed studies (workflow/scripts/power.py) and the
planned cells, their design and scaling (workflow/scripts/resize_design.py). Pilot rates and cell times here
are invented; the committed studies' intervals are the only real numbers read."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import yaml

from kvcert.scales import current_study, design_reference, load_scale, scales_folder

ROOT = Path(__file__).resolve().parents[1]
SCALES = scales_folder(ROOT)
STUDIES = {s: ROOT / "results" / s / "claims" for s in ("v1", "v2", "v2-full", "v3")}


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "workflow" / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def power():
    return _script("power")


@pytest.fixture(scope="module")
def resize():
    return _script("resize_design")


@pytest.fixture(scope="module")
def amendment():
    return yaml.safe_load((ROOT / "preregistration" / "amendment-4.yaml").read_text())


@pytest.fixture(scope="module")
def spec():
    """Amendment 4's plan, as its data states it (the locked document and its sidecar, pilot.py's amendment_data)."""
    return _script("pilot").amendment_data(ROOT / "preregistration" / "amendment-4.yaml")["plan"]


POPULATION = {"models": {
    "smollm2": {"window": 8, "kernel": 9,
                "question_aware": [{"name": "vt", "label": "vt_1_512", "num_chains": 1, "num_hops": 1, "context_tokens": 512}],
                "streaming": [{"name": "niah_multikey", "label": "niah_multikey_2", "num_needles": 2, "context_tokens": 1024}]},
    "gemma3": {"window": 16, "kernel": 5,
               "question_aware": [{"name": "cwe", "label": "cwe_2", "num_common": 2, "max_new_tokens": 30, "context_tokens": 1024}],
               "streaming": [{"name": "cwe", "label": "cwe_2", "num_common": 2, "max_new_tokens": 30, "context_tokens": 1024}]},
}}


def test_the_committed_variances_give_the_numbers_the_amendment_states(power, amendment):
    c1_c2 = power.items_for_span(STUDIES, ("c1", "c2"), 4.0)
    c7 = power.items_for_span(STUDIES, ("c7",), 4.0)
    k = power.c6_constant(STUDIES)
    # sd = width sqrt(n) / (2 * 1.96) of v1's C1 top-k at 25% ([-59.167, -40.833], 120 items)
    assert c1_c2["sd_max"] == pytest.approx(18.333 * math.sqrt(120) / (2 * 1.959964), abs=1e-3)
    assert c1_c2["sd_max_from"] == "v1 c1.accuracy_change[snapkv,topk,0.25]" and c1_c2["items"] == 2521
    assert c7["items"] == 521 and k["k_max"] == pytest.approx(3.217, abs=1e-3) and k["k_max_from"] == "v2"
    stated = amendment["power"]["committed_variances"]
    for number in ("51.23", "2521", "23.29", "521", "3.217", "636"):
        assert number in stated
    assert power.items_for_c6(k["k_max"], 0.15, 0.15, 0.15, 125) == 636
    # The 125-run floor binds when one class is rare: 125 / (3 * 0.02) = 2084 > the width's need.
    assert power.items_for_c6(k["k_max"], 0.02, 0.6, 0.15, 125) == max(
        math.ceil(3.217 * (1 / 0.02 + 1 / 0.6) / (3 * 0.0225)), 2084)
    with pytest.raises(SystemExit, match="never occurs"):
        power.items_for_c6(3.0, 0.0, 0.5, 0.15, 125)


def test_class_rates_weight_each_streaming_task_equally(power):
    rows = [{"model": "smollm2", "task": "niah_multikey_2", "stage": "D", "design": "poisson", "n_runs": 90,
             "n_fail_inherent": 9, "n_fail_cache": 45},
            {"model": "gemma3", "task": "cwe_2", "stage": "D", "design": "poisson", "n_runs": 90,
             "n_fail_inherent": 27, "n_fail_cache": 18}]
    rates = power.class_rates(rows, POPULATION)
    assert rates["p_inh"] == pytest.approx((0.1 + 0.3) / 2) and rates["p_cache"] == pytest.approx((0.5 + 0.2) / 2)
    with pytest.raises(SystemExit, match="no stage-D Poisson row for gemma3 cwe_2"):
        power.class_rates(rows[:1], POPULATION)


def test_planned_cells_are_valid_run_configs_with_the_chosen_knobs(resize, spec):
    from omegaconf import OmegaConf

    from kvcert.hydra_app import compose
    from kvcert.runner.config import validate

    counts = {f"{k}-{m}": 70 for m in POPULATION["models"] for k in resize.KINDS}
    cells = resize.planned_cells(POPULATION, counts, {"qa": 40, "streaming": 40, "oracle": 41}, spec)
    assert sorted(cells) == sorted(counts)
    for name, cell in cells.items():
        cfg = compose([f"model={cell['model']}", *cell["overrides"]])
        checked = validate(cfg)
        chosen = POPULATION["models"][cell["model"]]
        assert checked.observation_window == chosen["window"]
        assert checked.policy_options == {"snapkv": {"kernel_size": chosen["kernel"]}}
        assert checked.setting == ("streaming" if name.startswith("streaming") else "question_aware")
        tasks = OmegaConf.to_container(cfg.data, resolve=True)["tasks"]
        assert tasks == (chosen["streaming"] if name.startswith("streaming") else chosen["question_aware"])
        assert cell["shards"] == 2  # 70 items, 35 a shard
    assert "data.seed=41" in cells["oracle-gemma3"]["overrides"] and "oracle=true" in cells["oracle-gemma3"]["overrides"]


def test_the_design_scales_to_the_budget_and_keeps_c6s_floor(resize, spec):
    timing = {f"{k}-{m}": {"per_item_median": t} for m, ts in (("smollm2", (10.0, 16.0, 14.0)), ("gemma3", (20.0, 37.0, 22.0)))
              for k, t in zip(resize.KINDS, ts)}
    power = {"per_model": {"question_aware": 1261, "streaming": 320}}
    seeds = {"qa": 40, "streaming": 40, "oracle": 41}
    oracle = {"oracle_items": {"smollm2": 30, "gemma3": 16}, "spec": spec}
    out = resize.design(POPULATION, power, timing, 7800.0, seeds, c6_min_items=200, prereg=4, **oracle)
    counts = out["reproduce_90_minutes"]["counts"]
    assert not out["fits"] and out["reproduce_90_minutes"]["c6_floor_kept"]
    assert counts["streaming-smollm2"] == counts["streaming-gemma3"] == 100  # the floor, split between models
    assert counts["qa-smollm2"] + counts["qa-gemma3"] >= spec["min_qa_items"] == 100
    assert counts["oracle-smollm2"] == 30 and counts["oracle-gemma3"] == 16
    spent = sum(counts[c] * timing[c]["per_item_median"] for c in counts)
    assert spent <= 7800.0 and out["reproduce_90_minutes"]["estimated_cell_seconds"] == round(spent)
    assert counts["qa-smollm2"] == math.floor(1261 * out["reproduce_90_minutes"]["factor"])
    assert out["powered"]["counts"]["qa-gemma3"] == 1261
    assert out["powered"]["study"]["prereg"] == 4
    # A floor that leaves too little (or nothing) for the question-aware cells: uniform scaling, floor dropped.
    for floor in (300, 400):
        uniform = resize.design(POPULATION, power, timing, 7800.0, seeds, c6_min_items=floor, prereg=4,
                                **oracle)["reproduce_90_minutes"]
        assert not uniform["c6_floor_kept"]
        assert uniform["counts"]["streaming-smollm2"] == math.floor(320 * uniform["factor"])
    roomy = resize.design(POPULATION, power, timing, 1e7, seeds, c6_min_items=400, prereg=4, **oracle)
    assert roomy["fits"] and roomy["reproduce_90_minutes"]["counts"] == roomy["powered"]["counts"]


def _design_studies():
    """(scale, study) of every study of every scale file that applies a locked design (``design: {file, study}``):
    v4, v4-full, the current study and its powered design, and whatever a later amendment's scales add. A study
    still pending (its amendment a draft, ``pending: {until, why}``) has no design file yet and is left out."""
    out = []
    for path in sorted(SCALES.glob("*.yaml")):
        pending = load_scale(path.stem, SCALES).get("pending") or {}
        for study, spec in (yaml.safe_load(path.read_text()).get("studies") or {}).items():
            if isinstance(spec, dict) and "design" in spec and study not in pending:
                out.append((path.stem, study))
    return out


def test_the_current_study_and_the_records_apply_locked_designs():
    found = _design_studies()
    assert {("v4", "v4"), ("v4-full", "v4-full"), ("default", current_study(SCALES))} <= set(found)


@pytest.mark.parametrize("scale, study", _design_studies())
def test_the_scales_apply_the_locked_designs_studies(scale, study):
    """Studies v4 (`make reproduce-v4`), v4-full (`make reproduce-v4-full`), the current study (`make reproduce`)
    and its powered design reference their amendment's design.yaml: the file names the design and copies none of
    its cells, and the resolved study is the locked one."""
    design_file, key = design_reference(SCALES, scale, study)
    version = int(design_file.parent.name.removeprefix("amendment-"))
    assert design_file == ROOT / "preregistration" / f"amendment-{version}" / "design.yaml"
    assert key in ("reproduce_90_minutes.study", "powered.study")
    locked = yaml.safe_load(design_file.read_text())[key.split(".")[0]]["study"]
    written = yaml.safe_load((SCALES / f"{scale}.yaml").read_text())["studies"][study]
    assert written == {"design": {"file": f"../../preregistration/amendment-{version}/design.yaml", "study": key}}
    resolved = load_scale(scale, SCALES)["studies"][study]
    assert resolved == locked and resolved["prereg"] == version


def test_the_default_scale_reads_the_powered_study_as_a_record():
    """`make reproduce` tabulates v4's and v4-full's committed results beside the current study; `make reproduce-v4`
    and `make reproduce-v4-full` regenerate them."""
    default = yaml.safe_load((SCALES / "default.yaml").read_text())["studies"]
    assert default["v4"] == default["v4-full"] == {"prereg": 4, "archived": True}
    pending = load_scale("default", SCALES).get("pending") or {}
    order = [study for study in default if study not in pending]
    # the grid's columns: v4, its powered design, later records, then the current study last (a pending study,
    # whose amendment is not locked yet, computes nothing and is not a column)
    assert order.index("v4") + 1 == order.index("v4-full") and order[-1] == current_study(SCALES)


def test_the_scripts_driven_by_the_versions_data_recompute_amendment_4s_locked_files(tmp_path):
    """pilot.py choose, power.py and resize_design.py, called with the methods, document and power studies that
    amendment 4's data names (kvcert.analysis.prereg.versions, as design.smk calls them), write its locked
    pilot.csv, population.yaml, power.yaml and design.yaml byte for byte."""
    import subprocess
    import sys

    from kvcert.analysis import prereg

    v4 = prereg.version(4, ROOT)
    folder, scripts = v4.folder, ROOT / "workflow" / "scripts"
    studies = [f"{s}=results/{s}/claims" for s in v4.power_studies]
    commands = {
        "pilot.csv": [scripts / "pilot.py", "choose", "--amendment", v4.document, "--pilot", f"{folder}/pilot.csv",
                      "--csv", tmp_path / "pilot.csv", "--out", tmp_path / "population.yaml"],
        "power.yaml": [scripts / "power.py", "--method", v4.power, "--amendment", v4.document, "--studies", *studies,
                       "--pilot", f"{folder}/pilot.csv", "--population", f"{folder}/population.yaml",
                       "--out", tmp_path / "power.yaml"],
        "design.yaml": [scripts / "resize_design.py", "design", "--amendment", v4.document,
                        "--population", f"{folder}/population.yaml", "--timing", f"{folder}/timing.yaml",
                        "--power", f"{folder}/power.yaml", "--out", tmp_path / "design.yaml"],
    }
    for command in commands.values():
        subprocess.run([sys.executable, *map(str, command)], cwd=ROOT, check=True, capture_output=True, text=True)
    for name in ("pilot.csv", "population.yaml", "power.yaml", "design.yaml"):
        assert (tmp_path / name).read_bytes() == (ROOT / folder / name).read_bytes(), name

"""An amendment's design is data: its plan (cell plan, design rule, scorers, allocators, factors, budgets, seeds) is
named in its YAML, and one registry (kvcert.analysis.registry, kinds pilot, power, plan and design) maps the names to
functions.

The proof: amendment 5's locked design.yaml and power.yaml are rebuilt byte for byte from its data (the locked
document, and for the keys it states only in words, its sidecar spec.yaml) through the methods its data names; a
changed value in the data changes the design; and every way the data can be wrong is one line. The cells and times
here are the locked files'; nothing is run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from kvcert.analysis import registry
from kvcert.analysis.errors import AnalysisError
from helpers.scripts import workflow_script

ROOT = Path(__file__).resolve().parents[1]
FIVE = ROOT / "preregistration" / "amendment-5"


_script = workflow_script


@pytest.fixture(scope="module")
def scripts():
    return {name: _script(name) for name in ("pilot", "power", "resize_design")}


@pytest.fixture(scope="module")
def data(scripts):
    return scripts["pilot"].amendment_data(FIVE / "amendment.yaml")


def _design(scripts, document: Path, folder: Path, out: Path, *extra: str) -> str:
    scripts["resize_design"].amendment_main("design", [
        "--amendment", str(document), "--population", str(folder / "population.yaml"),
        "--timing", str(folder / "timing.yaml"), "--power", str(folder / "power.yaml"), "--out", str(out), *extra])
    return out.read_text()


def test_amendment_5s_design_is_rebuilt_from_its_data_through_the_registry_byte_for_byte(scripts, data, tmp_path):
    # The data names the methods; the registry, not the amendment's number or its power method, picks them.
    plan = data["plan"]
    assert (plan["method"], plan["design"]) == ("cell_per_configuration", "floors_then_scale")
    assert registry.method("plan", plan["method"], "t") is scripts["resize_design"].configuration_cells
    assert registry.method("design", plan["design"], "t") is scripts["resize_design"].floors_then_scale
    assert registry.method("power", data["power"]["method"], "t") is scripts["power"].per_component_span
    assert registry.method("pilot", data["pilot"]["method"], "t") is scripts["pilot"].reuse_population
    # The locked document states none of the plan: the sidecar fills it, and only it.
    locked = yaml.safe_load((FIVE / "amendment.yaml").read_text())
    assert "plan" not in locked and "span_targets" not in locked["power"]
    assert {k: v for k, v in data.items() if k != "plan"} == {
        **locked, "power": {**locked["power"], "span_targets": data["power"]["span_targets"]}}

    got = _design(scripts, FIVE / "amendment.yaml", FIVE, tmp_path / "design.yaml")
    assert got == (FIVE / "design.yaml").read_text()
    assert (tmp_path / "design.yaml").read_bytes() == (FIVE / "design.yaml").read_bytes()

    studies = locked["power"]["studies"]
    scripts["power"].main(["--method", data["power"]["method"], "--amendment", str(FIVE / "amendment.yaml"),
                           "--studies", *(f"{s}={ROOT}/results/{s}/claims" for s in studies),
                           "--out", str(tmp_path / "power.yaml")])
    assert (tmp_path / "power.yaml").read_bytes() == (FIVE / "power.yaml").read_bytes()


def _copy_five(root: Path) -> Path:
    """preregistration/amendment-5/ (locked document, lock, sidecar, locked files) under ``root``."""
    folder = root / "preregistration" / "amendment-5"
    shutil.copytree(FIVE, folder)
    return folder


def _edit_sidecar(folder: Path, edit) -> None:
    doc = yaml.safe_load((folder / "spec.yaml").read_text())
    edit(doc)
    (folder / "spec.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def test_the_data_drives_the_design(scripts, tmp_path):
    """A value changed in the data (a share dropped, an allocator's scorers) changes the cells; the locked design's
    other cells stay as they were, override for override."""
    folder = _copy_five(tmp_path)
    locked = yaml.safe_load((FIVE / "design.yaml").read_text())["reproduce_90_minutes"]["study"]["cells"]

    def edit(doc):
        doc["plan"]["factors"][0]["values"] = [0.5, 0.8]
        doc["plan"]["allocators"]["adakv"] = ["snapkv", "tova"]

    _edit_sidecar(folder, edit)  # the cells keep their names, so the locked timing.yaml prices them
    got = yaml.safe_load(_design(scripts, folder / "amendment.yaml", folder, tmp_path / "design.yaml"))
    cells = got["reproduce_90_minutes"]["study"]["cells"]
    assert not [c for c in cells if "share0.95" in c]
    assert sorted(c for c in cells) == sorted(c for c in locked if "share0.95" not in c)
    assert "policies=[snapkv,tova]" in cells["qa-gemma3-adakv"]["overrides"]
    assert "policy_options={snapkv:{kernel_size:5}}" in cells["qa-gemma3-adakv"]["overrides"]  # tova pools nothing
    unchanged = [c for c in cells if "-adakv" not in c]
    assert all(cells[c]["overrides"][4:] == locked[c]["overrides"][4:] for c in unchanged)  # but n_items


def test_a_second_factor_crosses_the_first_and_may_read_the_pilots_choice(scripts, data):
    """An amendment-6-shaped plan: a second factor (here design_options.pi_min; amendment 6's tail mix and
    attention-aware head are the same kind of key) whose value the pilot chose (``population:<key>``). One cell per
    (allocator, share, value); top-k only where every factor is at its default; the default is the run schema's."""
    resize = scripts["resize_design"]
    population = yaml.safe_load((FIVE / "population.yaml").read_text())
    population["chosen"] = {"pi_min": 0.01}
    spec = {**data["plan"], "allocators": {"uniform": ["snapkv"]},
            "factors": [*data["plan"]["factors"],
                        {"override": "design_options.pi_min", "label": "floor", "values": [0.001, "population:chosen.pi_min"]}]}
    counts = {f"{k}-{m}": 4 for m in population["models"] for k in resize.KINDS}
    cells = resize.configuration_cells(population, counts, {"qa": 1, "oracle": 2, "streaming": 1}, spec)
    qa = sorted(c for c in cells if c.startswith("qa-smollm2"))
    assert qa == sorted(["qa-smollm2", "qa-smollm2-floor0.01", "qa-smollm2-share0.8", "qa-smollm2-share0.8-floor0.01",
                         "qa-smollm2-share0.95", "qa-smollm2-share0.95-floor0.01"])
    assert "design_options.pi_min=0.01" in cells["qa-smollm2-share0.8-floor0.01"]["overrides"]
    assert not any("pi_min" in o for o in cells["qa-smollm2-share0.8"]["overrides"])  # the default is elided
    topk = [c for c in cells if "designs=[topk,poisson]" in cells[c]["overrides"]]
    assert sorted(topk) == ["qa-gemma3", "qa-smollm2"]
    smoke = resize.smoke_spec(spec)
    assert [f["values"] for f in smoke["factors"]] == [[0.5, 0.95], [0.001, "population:chosen.pi_min"]]
    # Two factors marked alone (amendment 6's two defenses, each with and without): never both off their defaults.
    population["chosen"]["n_recent"] = 64
    alone = {**spec, "factors": [{**f, "alone": True} for f in spec["factors"][1:]]
             + [{"override": "design_options.n_recent", "label": "recent", "values": [32, "population:chosen.n_recent"],
                 "alone": True}]}
    cells = resize.configuration_cells(population, counts, {"qa": 1, "oracle": 2, "streaming": 1}, alone)
    assert sorted(c for c in cells if c.startswith("qa-smollm2")) == ["qa-smollm2", "qa-smollm2-floor0.01",
                                                                      "qa-smollm2-recent64"]


def _one_line(error) -> str:
    text = str(error)
    assert "\n" not in text.strip(), text
    return text


def test_bad_data_is_one_line(scripts, tmp_path):
    folder = _copy_five(tmp_path)
    document = folder / "amendment.yaml"

    def design_error() -> str:
        with pytest.raises(SystemExit) as error:
            _design(scripts, document, folder, tmp_path / "design.yaml")
        return _one_line(error.value)

    original = (folder / "spec.yaml").read_text()
    _edit_sidecar(folder, lambda d: d["plan"].update(method="cell_per_scorer"))
    message = design_error()
    assert message.startswith(f"{folder / 'spec.yaml'}: plan.method='cell_per_scorer': no plan method")
    assert "known: cell_per_configuration, cell_per_kind" in message
    (folder / "spec.yaml").write_text(original)
    _edit_sidecar(folder, lambda d: d["plan"]["factors"][0].update(default=0.8))
    assert "plan.factors[0].default=0.8: the run schema's default of design_options.head_fraction is 0.5" in design_error()
    (folder / "spec.yaml").write_text(original)
    _edit_sidecar(folder, lambda d: d["plan"].update(scorers=["snapkv", "nosuch"]))
    assert "plan.scorers: 'nosuch' is not a registered policy" in design_error()
    (folder / "spec.yaml").write_text(original)
    _edit_sidecar(folder, lambda d: d["plan"].pop("budgets"))
    assert design_error().endswith("plan lacks budgets")
    # The sidecar fills only what the locked document lacks, and only beside a locked document.
    (folder / "spec.yaml").write_text(original + "version: 6\n")
    assert "spec.yaml: version: the document states it" in design_error()
    (folder / "spec.yaml").write_text(original)
    (folder / "amendment.lock").unlink()
    assert "beside a document without a lock" in design_error()
    (folder / "spec.yaml").unlink()
    assert "plan: missing" in design_error()
    assert not (tmp_path / "design.yaml").exists()  # nothing half-written


def test_the_registry_refuses_a_second_function_under_a_name():
    assert registry.method("power", "per_component_span", "t")  # registered by power.py, loaded above
    with pytest.raises(ValueError, match="registered twice"):
        registry.register_method("power", "per_component_span")(lambda args, parser: "")
    with pytest.raises(ValueError, match="method kind 'cells': unknown"):
        registry.register_method("cells", "x")
    with pytest.raises(AnalysisError, match=r"^doc.yaml: pilot.method='nosuch': no pilot method of that name; known: "):
        registry.method("pilot", "nosuch", "doc.yaml: pilot.method")


def test_a_script_loaded_twice_registers_the_same_functions_again():
    """design.smk and power.py load pilot.py under their own module names: the second load replaces the first's
    functions under the same names instead of failing."""
    first = _script("pilot").PILOTS
    again = _script("pilot")
    assert sorted(first) == sorted(again.PILOTS) and {"reuse_population", "staged", "threshold"} <= set(first)
    assert {n: f.__qualname__ for n, f in first.items()} == {n: f.__qualname__ for n, f in again.PILOTS.items()}
    assert again.POPULATION_STEPS["staged"] == "per_model" and again.POPULATION_STEPS["reuse_population"] == "whole"
    assert "threshold" not in again.POPULATION_STEPS  # chosen by hand: the workflow does not run it


def test_a_registered_configuration_column_keeps_the_other_claims_on_its_default(monkeypatch):
    """A later factor's column (amendment 6's tail mix, say) registered with its default: the claims that are not
    decided per configuration read only the rows at that default (a missing value is the default); with nothing
    registered, every table is read as it is (the committed studies)."""
    import pandas as pd

    from kvcert.analysis.claims import ClaimDef, Tables

    items = pd.DataFrame({"tail_mix": [0.0, 0.2, None, 1.0], "item_id": ["a", "b", "c", "d"]})
    seen = []

    def run_claim(claim_id, tables, spec, conventions, opts):
        seen.append(list(tables.items["item_id"]))

    run = registry.on_default_configuration({"c1": ClaimDef(lambda *a: None, ("items",))}, run_claim)
    assert registry.CONFIGURATION_COLUMNS == {"tail_mix": 0.0, "head_attention_share": 0.0}  # the two defenses
    monkeypatch.setattr(registry, "CONFIGURATION_COLUMNS", {})
    run("c1", Tables(items=items), {}, {}, None)
    registry.register_configuration_column("tail_mix", 0.0)
    run("c1", Tables(items=items), {}, {}, None)
    assert seen == [["a", "b", "c", "d"], ["a", "c"]]
    with pytest.raises(ValueError, match="registered with default 0.0"):
        registry.register_configuration_column("tail_mix", 0.5)

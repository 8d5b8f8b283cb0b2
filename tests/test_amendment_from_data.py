"""An amendment is a folder of data: a throwaway amendment, built in a temporary copy of the pre-registration from
an earlier amendment's data with a new number and no Python, is discovered, piloted, designed, locked and applied
to a smoke-sized study. Two shapes: amendment 4's (one cell per kind and model) and amendment 5's (scorers,
allocators and a certain-head share factor, one cell per configuration, C2 and C3 decided per configuration).

Amendment 4's shape:

The folder preregistration/amendment-5/ holds amendment.yaml (amendment 4's document, renumbered, its pilot
reduced to the smoke pilot's size: SmolLM2 only, 2 items of one variant, bands open; its power's oracle counts
stated as data) and what the stages write there. The pilot runs by the method the document names, in two forms:
``staged`` (marked long, `make test-long`: the stages run for real on the smoke model and items,
workflow/scripts/pilot.py --method staged --smoke, then choose) and ``reuse_population`` (the bounded form in
`make test`: amendment 4's locked population copied, no stage runs); the measured cell times and the power analysis
are amendment 4's committed files reduced to smoke size (SmolLM2's rows, 3 items per cell), because the smoke
pilot's class rates are not a basis for a power rule; the design is computed from them by resize_design.py; the
lock is kvcert-prereg's; the study runs the design's cells (kvcert-run, 1 thread) and every claim under version 5.
Every number here is test data, never a result.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvcert.analysis import cli, prereg, registry
from kvcert.scales import cell_overrides, load_scale, scales_folder, studies
from helpers.scripts import workflow_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "workflow" / "scripts"
BIN = Path(sys.executable).parent
OWN_FILES = ["pilot.csv", "population.yaml", "timing.yaml", "power.yaml", "design.yaml"]

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]


def _script(name: str):
    return workflow_script(name, register=True)


def _copy(root: Path, upto: int = 4) -> Path:
    """preregistration/ and the frozen analysis sources under ``root``: versions 1 to ``upto`` as locked."""
    shutil.copytree(ROOT / "preregistration", root / "preregistration")
    for document in (root / "preregistration").glob(f"amendment-*/{prereg.FOLDER_DOCUMENT}"):
        if yaml.safe_load(document.read_text())["version"] > upto:  # the repository's later amendments
            shutil.rmtree(document.parent)
    shutil.copytree(ROOT / "src" / "kvcert" / "analysis", root / "src" / "kvcert" / "analysis",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _amendment_5(root: Path, pilot: str) -> Path:
    """preregistration/amendment-5/amendment.yaml from amendment 4's data (its document and the plan its sidecar
    states): data only. pilot: its method."""
    doc = _script("pilot").amendment_data(ROOT / "preregistration" / "amendment-4.yaml")
    doc.update(version=5, status="DRAFT: a throwaway amendment built by a test",
               amends={"version": 4, "document": "preregistration/amendment-4.yaml",
                       "lock": "preregistration/amendment-4.lock"},
               freezes=_own_files(pilot))
    doc["pilot"] = {**doc["pilot"], "method": pilot, "models": ["smollm2"]}
    if pilot == "reuse_population":
        doc["pilot"]["population_from"] = "preregistration/amendment-4/population.yaml"
    doc["power"] = {**doc["power"], "method": "studies_span_targets", "studies": ["v1", "v2", "v2-full", "v3"],
                    "oracle_items": {"smollm2": 2}, "timing": {"n_items": 1, "budget_minutes": 65, "cores": 1}}
    folder = root / "preregistration" / "amendment-5"
    folder.mkdir()
    (folder / "amendment.yaml").write_text(yaml.safe_dump(doc, sort_keys=False, width=110))
    return folder


def _smoke_sized_power(folder: Path) -> None:
    """Amendment 4's committed timing and power, reduced to SmolLM2 and 3 items per cell."""
    timing = yaml.safe_load((ROOT / "preregistration" / "amendment-4" / "timing.yaml").read_text())
    timing["measured"] = {c: v for c, v in timing["measured"].items() if c.endswith("-smollm2")}
    (folder / "timing.yaml").write_text(yaml.safe_dump(timing, sort_keys=False))
    power = yaml.safe_load((ROOT / "preregistration" / "amendment-4" / "power.yaml").read_text())
    power["per_model"] = {"question_aware": 3, "streaming": 3}
    (folder / "power.yaml").write_text(yaml.safe_dump(power, sort_keys=False))


def _own_files(pilot: str) -> list[str]:
    return [f for f in OWN_FILES if pilot == "staged" or f != "pilot.csv"]  # reusing a population writes no rows


def _locked_design_study(root: Path, version: int) -> tuple[dict, dict]:
    """A scale v<version> in root's configs/scales whose one study applies amendment <version>'s locked design
    (SmolLM2 only); returns (scale, its study)."""
    scales = scales_folder(root)
    scales.mkdir(parents=True)
    (scales / f"v{version}.yaml").write_text(yaml.safe_dump({
        "outdir": "results", "figure_dir": "figures", "threads_per_cell": 1, "prereg_scale": "default",
        "models": {"smollm2": ["model=smollm2"]},
        "studies": {f"v{version}": {"design": {"file": f"../../preregistration/amendment-{version}/design.yaml",
                                               "study": "powered.study"}}}}))
    scale = load_scale(f"v{version}", scales)
    return scale, studies(scale)[f"v{version}"]


def _run_cells(scale: dict, study: dict, out_root: Path) -> list[str]:
    """Every cell of the study through kvcert-run, one thread each; returns the cell folders in the study's order."""
    folders = []
    for name, cell in study["cells"].items():
        out = out_root / name
        subprocess.run([str(BIN / "kvcert-run"), *cell_overrides(scale, cell), "threads=1", "progress=false",
                        f"out_dir={out}"], check=True, capture_output=True, text=True)
        folders.append(str(out))
    return folders


@pytest.mark.parametrize("pilot", [pytest.param("staged", marks=pytest.mark.long), "reuse_population"])
def test_a_throwaway_amendment_runs_from_data_alone(tmp_path, pilot):
    root = _copy(tmp_path / "repo")
    folder = _amendment_5(root, pilot)

    # Discovered from the folder: what it freezes, its analysis (inherited), its methods; still a draft.
    v5, v4 = prereg.version(5, root), prereg.version(4, root)
    rel = "preregistration/amendment-5"
    assert v5.files == (*v4.files, f"{rel}/amendment.yaml", *(f"{rel}/{f}" for f in _own_files(pilot)))
    assert (v5.lock, v5.analysis, v5.choices) == (f"{rel}/amendment.lock", "amendment2", (("c5_gating", "within_model"),))
    assert (v5.pilot, v5.power, v5.models) == (pilot, "studies_span_targets", ("smollm2",))
    assert prereg.newest(root) == 5 and prereg.latest(root) == 4
    with pytest.raises(prereg.PreregistrationError, match="is a draft"):
        prereg.write_lock(root, number=5)

    # Pilot, by the method the data names: staged runs stages A-D on the smoke model and items, then its rules;
    # reuse_population copies amendment 4's locked population.
    run = [sys.executable, str(SCRIPTS / "pilot.py")]
    if pilot == "staged":
        rows = tmp_path / "pilot-smollm2.csv"
        subprocess.run([*run, "--method", v5.pilot, "--smoke", "--amendment", str(root / v5.document),
                        "--model", "smollm2", "--out", str(rows)], check=True, capture_output=True, text=True)
        subprocess.run([*run, "choose", "--amendment", str(root / v5.document), "--pilot", str(rows),
                        "--csv", str(folder / "pilot.csv"), "--out", str(folder / "population.yaml")],
                       check=True, capture_output=True, text=True)
    else:
        subprocess.run([*run, "--method", v5.pilot, "--amendment", str(root / v5.document),
                        "--out", str(folder / "population.yaml")], check=True, capture_output=True, text=True)
    population = yaml.safe_load((folder / "population.yaml").read_text())
    assert list(population["models"]) == ["smollm2"]

    # Design: resize_design.py on the pilot's population and the smoke-sized times and power.
    _smoke_sized_power(folder)
    subprocess.run([sys.executable, str(SCRIPTS / "resize_design.py"), "design", "--amendment", str(root / v5.document),
                    "--population", str(folder / "population.yaml"), "--timing", str(folder / "timing.yaml"),
                    "--power", str(folder / "power.yaml"), "--out", str(folder / "design.yaml")],
                   check=True, capture_output=True, text=True)
    design = yaml.safe_load((folder / "design.yaml").read_text())
    assert design["powered"]["study"]["prereg"] == 5
    assert design["powered"]["counts"] == {"qa-smollm2": 3, "streaming-smollm2": 3, "oracle-smollm2": 2}

    # Lock: the document says it is no longer a draft; kvcert-prereg freezes versions 1-5.
    document = root / v5.document
    document.write_text(document.read_text().replace("status: 'DRAFT: a throwaway amendment built by a test'",
                                                     "status: locked by a test"))
    prereg.write_lock(root, number=5)
    prereg.verify_lock(root, 5)
    assert json.loads((root / v5.lock).read_text())["files"] == list(v5.files)

    # Study: a scale that references the locked design; its cells run, then every claim under version 5.
    scale, study = _locked_design_study(root, 5)
    assert study["prereg"] == 5 and sorted(study["cells"]) == ["oracle-smollm2", "qa-smollm2", "streaming-smollm2"]
    cells = _run_cells(scale, study, tmp_path / "cells")
    for claim in ("c1", "c2", "c3", "c4", "c5", "c6", "c7"):
        result = cli.run({"claim": claim, "cells": cells, "prereg_root": str(root), "prereg_version": 5,
                          "figures": False, "n_boot": 20, "out": str(tmp_path / "claims" / f"{claim}.json")})
        assert result.details["prereg_version"] == 5
        assert result.verdict in ("supported", "not supported", "inconclusive")
    c5 = json.loads((tmp_path / "claims" / "c5.json").read_text())
    assert c5["details"]["analysis_variant"] == {"c5_gating": "within_model"}  # inherited from amendment 4, by name
    assert registry.analysis(v5)[0]["c5"].fn.__name__ == "escalation_within_model"


# --- amendment 5's shape: scorers, allocators and a certain-head share factor, as data ----------------------------

SHAPE_5_FILES = ["population.yaml", "timing.yaml", "power.yaml", "design.yaml"]
SMOKE_PLAN = {"scorers": {"snapkv": "SnapKVPress", "knorm": "KnormPress"},
              "allocators": {"uniform": "scorers", "adakv": ["snapkv"]},
              "factors": [{"override": "design_options.head_fraction", "label": "share", "values": [0.5, 0.95],
                           "default": 0.5}],
              "poisson_seeds": [0]}


def _amendment_6(root: Path) -> Path:
    """preregistration/amendment-6/amendment.yaml from amendment 5's data (its locked document and its sidecar's
    plan), renumbered, its plan smoke-sized as data (two scorers, two allocators, two shares, one Poisson seed) and
    its population reused from amendment 5's locked file, SmolLM2 only."""
    five = ROOT / "preregistration" / "amendment-5" / "amendment.yaml"
    doc = _script("pilot").amendment_data(five)
    doc.update(version=6, status="DRAFT: a throwaway amendment of amendment 5's shape, built by a test",
               amends={"version": 5, "document": "preregistration/amendment-5/amendment.yaml",
                       "lock": "preregistration/amendment-5/amendment.lock"},
               freezes=SHAPE_5_FILES, plan={**doc["plan"], **SMOKE_PLAN})
    doc["pilot"] = {**doc["pilot"], "models": ["smollm2"],
                    "population_from": "preregistration/amendment-5/population.yaml"}
    doc["power"] = {**doc["power"], "timing": {"n_items": 1, "budget_minutes": 65, "cores": 1}}
    folder = root / "preregistration" / "amendment-6"
    folder.mkdir()
    (folder / "amendment.yaml").write_text(yaml.safe_dump(doc, sort_keys=False, width=110))
    return folder


def _smoke_sized_power_5(folder: Path) -> None:
    """Amendment 5's committed timing (SmolLM2's cells) and power, reduced to a few items per cell."""
    five = ROOT / "preregistration" / "amendment-5"
    timing = yaml.safe_load((five / "timing.yaml").read_text())
    timing["measured"] = {c: v for c, v in timing["measured"].items() if "-smollm2" in c}
    (folder / "timing.yaml").write_text(yaml.safe_dump(timing, sort_keys=False))
    power = yaml.safe_load((five / "power.yaml").read_text())
    power["models"] = ["smollm2"]
    power["per_model"] = {"question_aware": 3, "oracle": 2, "streaming": 3, "streaming_c6_floor": 3}
    (folder / "power.yaml").write_text(yaml.safe_dump(power, sort_keys=False))


# make test-long: nine real cells (974 s on loaded cores), more than CI's 90 minutes can hold beside the other tiers;
# amendment 5's design rebuilt from its data alone (tests/test_amendment_as_data.py) runs in make test.
@pytest.mark.long
def test_a_throwaway_amendment_of_amendment_5s_shape_runs_from_data_alone(tmp_path):
    root = _copy(tmp_path / "repo", upto=5)
    folder = _amendment_6(root)
    v6, v5 = prereg.version(6, root), prereg.version(5, root)
    rel = "preregistration/amendment-6"
    assert v6.files == (*v5.files, f"{rel}/amendment.yaml", *(f"{rel}/{f}" for f in SHAPE_5_FILES))
    assert v6.choices == v5.choices and dict(v6.choices)["c3_scope"] == "per_configuration"  # inherited by name
    assert (v6.pilot, v6.power) == ("reuse_population", "per_component_span")
    assert prereg.newest(root) == 6 and prereg.latest(root) == 5

    run = [sys.executable, str(SCRIPTS / "pilot.py")]
    subprocess.run([*run, "--method", v6.pilot, "--amendment", str(root / v6.document),
                    "--out", str(folder / "population.yaml")], check=True, capture_output=True, text=True)
    assert list(yaml.safe_load((folder / "population.yaml").read_text())["models"]) == ["smollm2"]

    _smoke_sized_power_5(folder)
    subprocess.run([sys.executable, str(SCRIPTS / "resize_design.py"), "design", "--amendment", str(root / v6.document),
                    "--population", str(folder / "population.yaml"), "--timing", str(folder / "timing.yaml"),
                    "--power", str(folder / "power.yaml"), "--out", str(folder / "design.yaml")],
                   check=True, capture_output=True, text=True)
    design = yaml.safe_load((folder / "design.yaml").read_text())
    cells = design["powered"]["study"]["cells"]
    configurations = ["", "-share0.95", "-adakv", "-adakv-share0.95"]
    assert sorted(cells) == sorted([*(f"qa-smollm2{c}" for c in configurations),
                                    *(f"oracle-smollm2{c}" for c in configurations), "streaming-smollm2"])
    assert "policies=[snapkv,knorm]" in cells["qa-smollm2-share0.95"]["overrides"]
    assert "policies=[snapkv]" in cells["oracle-smollm2-adakv"]["overrides"]

    document = root / v6.document
    locked = {**yaml.safe_load(document.read_text()), "status": "locked by a test"}
    document.write_text(yaml.safe_dump(locked, sort_keys=False, width=110))
    prereg.write_lock(root, number=6)
    prereg.verify_lock(root, 6)

    scale, study = _locked_design_study(root, 6)
    assert study["prereg"] == 6 and sorted(study["cells"]) == sorted(cells)
    ran = _run_cells(scale, study, tmp_path / "cells")
    results = {}
    for claim in ("c1", "c2", "c3", "c4", "c5", "c6", "c7"):
        results[claim] = cli.run({"claim": claim, "cells": ran, "prereg_root": str(root), "prereg_version": 6,
                                  "figures": False, "n_boot": 20, "out": str(tmp_path / "claims" / f"{claim}.json")})
        assert results[claim].details["prereg_version"] == 6
    # The data's factors reach the analysis: one C3 component per (scorer, allocator, share) the plan names, one C2
    # component per Poisson configuration and budget.
    pairs = [("snapkv", "uniform"), ("knorm", "uniform"), ("snapkv", "adakv")]
    c3 = {c["name"] for c in results["c3"].details["components"]}
    assert c3 == {f"{m}[{s},{a},{h}]" for m in ("coverage", "spearman") for s, a in pairs for h in ("0.5", "0.95")}
    c2 = {c["name"] for c in results["c2"].details["components"]}
    assert c2 == {f"poisson_minus_topk[{s},{a},{h},{b}]" for s, a in pairs for h in ("0.5", "0.95")
                  for b in ("0.25", "0.5")}
    assert results["c3"].details["analysis_variant"] == {"c3_scope": "per_configuration"}

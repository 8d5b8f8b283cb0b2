"""An amendment is a folder of data: a throwaway amendment 5, built in a temporary copy of the pre-registration
from amendment 4's document with a new number and no Python, is discovered, piloted, designed, locked and
applied to a smoke-sized study.

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

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvcert.analysis import cli, prereg, registry
from kvcert.scales import cell_overrides, load_scale, studies

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "workflow" / "scripts"
BIN = Path(sys.executable).parent
OWN_FILES = ["pilot.csv", "population.yaml", "timing.yaml", "power.yaml", "design.yaml"]

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _copy(root: Path) -> Path:
    """preregistration/ and the frozen analysis sources under ``root``: versions 1-4 as locked."""
    shutil.copytree(ROOT / "preregistration", root / "preregistration")
    for document in (root / "preregistration").glob(f"amendment-*/{prereg.FOLDER_DOCUMENT}"):
        if yaml.safe_load(document.read_text())["version"] > 4:  # the repository's own amendments 5, ...: not 1-4
            shutil.rmtree(document.parent)
    shutil.copytree(ROOT / "src" / "kvcert" / "analysis", root / "src" / "kvcert" / "analysis",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _amendment_5(root: Path, pilot: str) -> Path:
    """preregistration/amendment-5/amendment.yaml from amendment 4's document: data only. pilot: its method."""
    doc = yaml.safe_load((ROOT / "preregistration" / "amendment-4.yaml").read_text())
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
    scales = root / "workflow" / "scales"
    scales.mkdir(parents=True)
    (scales / "v5.yaml").write_text(yaml.safe_dump({
        "outdir": "results", "figure_dir": "figures", "threads_per_cell": 1, "prereg_scale": "default",
        "models": {"smollm2": ["model=smollm2"]},
        "studies": {"v5": {"design": {"file": "../../preregistration/amendment-5/design.yaml",
                                      "study": "powered.study"}}}}))
    scale = load_scale("v5", scales)
    study = studies(scale)["v5"]
    assert study["prereg"] == 5 and sorted(study["cells"]) == ["oracle-smollm2", "qa-smollm2", "streaming-smollm2"]
    cells = []
    for name, cell in study["cells"].items():
        out = tmp_path / "cells" / name
        subprocess.run([str(BIN / "kvcert-run"), *cell_overrides(scale, cell), "threads=1", "progress=false",
                        f"out_dir={out}"], check=True, capture_output=True, text=True)
        cells.append(str(out))
    for claim in ("c1", "c2", "c3", "c4", "c5", "c6", "c7"):
        result = cli.run({"claim": claim, "cells": cells, "prereg_root": str(root), "prereg_version": 5,
                          "figures": False, "n_boot": 20, "out": str(tmp_path / "claims" / f"{claim}.json")})
        assert result.details["prereg_version"] == 5
        assert result.verdict in ("supported", "not supported", "inconclusive")
    c5 = json.loads((tmp_path / "claims" / "c5.json").read_text())
    assert c5["details"]["analysis_variant"] == {"c5_gating": "within_model"}  # inherited from amendment 4, by name
    assert registry.analysis(v5)[0]["c5"].fn.__name__ == "escalation_within_model"

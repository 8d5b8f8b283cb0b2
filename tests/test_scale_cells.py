"""Every scale's cells, as kvcert.scales resolves them, equal the cells captured in tests/fixtures/scale_cells.json
before the scales stopped copying their locked designs: the same studies, cells, models, shards and override
strings in the same order (the cell rule's params, so no committed cell is rerun).

The capture names no current study: a later amendment adds its study (and its scales) as data, and the capture
still holds. A study or scale added since the capture must apply a locked design (``design: {file, study}``: its
cells are the lock's) or be a record; a captured study that a scale now reads as a record (the default scale's, once
a newer amendment becomes the default) must still be computed, with its captured cells, by some scale (its own
scale file, e.g. configs/scales/v5.yaml).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvcert.scales import current_study, design_reference, exploratory, load_scale, scale_names, scales_folder, studies

ROOT = Path(__file__).resolve().parents[1]
SCALES = scales_folder(ROOT)
CAPTURED = json.loads((ROOT / "tests" / "fixtures" / "scale_cells.json").read_text())


def resolved(name: str) -> dict:
    scale = load_scale(name, SCALES)
    return {"studies": {study: {"prereg": spec["prereg"], "source": spec["source"], "archived": spec["archived"],
                                "cells": {cell: dict(c) for cell, c in spec["cells"].items()}}
                        for study, spec in studies(scale).items()},
            "exploratory": {study: {cell: dict(c) for cell, c in spec["cells"].items()}
                            for study, spec in exploratory(scale).items()},
            "models": scale.get("models")}


def _applies_a_locked_design(scale: str, study: str) -> bool:
    path, key = design_reference(SCALES, scale, study)
    version = int(path.parent.name.removeprefix("amendment-"))
    folder_lock, indexed_lock = path.parent / "amendment.lock", path.parent.with_suffix(".lock")  # amendment-N.lock
    lock = folder_lock if folder_lock.is_file() else indexed_lock
    locked = json.loads(lock.read_text())["files"] if lock.is_file() else []
    return f"preregistration/amendment-{version}/{path.name}" in locked and bool(key)


def _new_study_is_locked_or_a_record(scale: str, study: str, spec: dict) -> None:
    if spec["archived"]:
        return
    raw = yaml.safe_load((SCALES / f"{scale}.yaml").read_text()).get("studies") or {}
    assert isinstance(raw.get(study), dict) and "design" in raw[study], (
        f"{scale}: study {study} is not in the capture: it must apply a locked design or be a record")
    assert _applies_a_locked_design(scale, study), f"{scale}: study {study}: its design file is not locked"


def test_every_captured_scale_exists():
    assert set(CAPTURED) <= set(scale_names(SCALES))


@pytest.mark.parametrize("name", sorted(set(CAPTURED) | set(scale_names(SCALES))))
def test_a_scale_resolves_to_the_captured_cells(name):
    got = resolved(name)
    want = CAPTURED.get(name)
    if want is None:  # a scale added since the capture: every study it computes applies a locked design
        for study, spec in got["studies"].items():
            _new_study_is_locked_or_a_record(name, study, spec)
        return
    assert got["models"] == want["models"] and got["exploratory"] == want["exploratory"]
    for study, spec in want["studies"].items():  # a per-cell comparison first, so that a failure names the cell
        assert study in got["studies"], f"{name}: captured study {study} is gone"
        if got["studies"][study]["archived"] and not spec["archived"]:
            # Read as a record here now: some scale still computes it, with the captured cells.
            computing = [other for other in scale_names(SCALES)
                         if resolved(other)["studies"].get(study, {}).get("cells") == spec["cells"]]
            assert computing, f"{name}: study {study} became a record, and no scale computes its captured cells"
            continue
        for cell, c in spec["cells"].items():
            assert got["studies"][study]["cells"].get(cell) == c, f"{name}: {study}/{cell}"
        assert got["studies"][study] == spec, f"{name}: {study}"
    for study in set(got["studies"]) - set(want["studies"]):
        _new_study_is_locked_or_a_record(name, study, got["studies"][study])


def test_the_default_scale_computes_one_study_and_it_applies_a_locked_design():
    study = current_study(SCALES)
    assert _applies_a_locked_design("default", study)
    assert resolved("default")["studies"][study]["cells"]

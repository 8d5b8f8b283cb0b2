"""Every scale's cells, as kvcert.scales resolves them, equal the cells captured in tests/fixtures/scale_cells.json
before the scales stopped copying their locked designs: the same studies, cells, models, shards and override
strings in the same order (the cell rule's params, so no committed cell is rerun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcert.scales import exploratory, load_scale, scale_names, studies

ROOT = Path(__file__).resolve().parents[1]
SCALES = ROOT / "workflow" / "scales"
CAPTURED = json.loads((ROOT / "tests" / "fixtures" / "scale_cells.json").read_text())


def resolved(name: str) -> dict:
    scale = load_scale(name, SCALES)
    return {"studies": {study: {"prereg": spec["prereg"], "source": spec["source"], "archived": spec["archived"],
                                "cells": {cell: dict(c) for cell, c in spec["cells"].items()}}
                        for study, spec in studies(scale).items()},
            "exploratory": {study: {cell: dict(c) for cell, c in spec["cells"].items()}
                            for study, spec in exploratory(scale).items()},
            "models": scale.get("models")}


def test_every_scale_is_captured():
    assert sorted(CAPTURED) == scale_names(SCALES)


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_a_scale_resolves_to_the_captured_cells(name):
    got = resolved(name)
    want = CAPTURED[name]
    for study in want["studies"]:  # a per-cell comparison first, so that a failure names the cell
        for cell, spec in want["studies"][study]["cells"].items():
            assert got["studies"][study]["cells"].get(cell) == spec, f"{name}: {study}/{cell}"
    assert got == want

"""The committed records (results/<study>/) are bound to the design and the code that made them: every shard
the study's scale file names has its committed config and manifest, the manifest hashes that config, one
clean library made the whole study, the shards' items add up to the design, and each claim counts them."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml

from kvcert.analysis import prereg
from kvcert.scales import current_study, design_reference, load_scale, override_value, scales_folder, studies

ROOT = prereg.find_root(__file__)
RECORDS = [("v1", "v1"), ("v2", "v2"), ("v2-full", "v2-full"), ("v3", "v3"), ("v4", "v4"), ("v4-full", "v4-full")]


def _cells(scale: str, study: str) -> dict:
    """The study's cells as the workflow reads them."""
    return studies(load_scale(scale, scales_folder(ROOT)))[study]["cells"]


def _n_items(cell: dict) -> int:
    return int(override_value(cell["overrides"], "n_items"))


def _manifests(study: str, name: str, cell: dict) -> list[dict]:
    out = []
    for k in range(cell["shards"]):
        shard = ROOT / "results" / study / "cells" / name / f"shard-{k}"
        assert (shard / "config.yaml").is_file(), f"{shard}/config.yaml is not committed"
        manifest = json.loads((shard / "manifest.json").read_text())
        digest = hashlib.sha256((shard / "config.yaml").read_bytes()).hexdigest()
        assert manifest["outputs_sha256"]["config.yaml"] == digest, f"{shard}: the manifest hashes another config"
        out.append(manifest)
    return out


@pytest.mark.parametrize("scale, study", RECORDS)
def test_a_record_is_its_design_made_by_one_clean_library(scale, study):
    fingerprints, question_aware, streaming = set(), 0, 0
    for name, cell in _cells(scale, study).items():
        manifests, n = _manifests(study, name, cell), _n_items(cell)
        assert sum(m["n_shard_items"] for m in manifests) == n, name
        assert not any(m["source"]["dirty"] for m in manifests), name
        fingerprints |= {m["code_fingerprint"] for m in manifests}
        if override_value(cell["overrides"], "setting") == "streaming":
            streaming += n
        else:
            question_aware += n
    assert len(fingerprints) == 1, f"study {study} was made by {len(fingerprints)} libraries"
    counted = {c: json.loads((ROOT / "results" / study / "claims" / f"{c}.json").read_text())["n"]
               for c in ("c1", "c2", "c7")}
    assert counted == {"c1": question_aware, "c2": question_aware, "c7": streaming}


def test_the_powered_record_was_made_by_version_3s_library():
    """make reproduce-full ran on the library that made study v3: the two differ by design and items, not code."""
    def fingerprint(scale, study):
        name, cell = next(iter(_cells(scale, study).items()))
        return _manifests(study, name, cell)[0]["code_fingerprint"]

    assert fingerprint("v2-full", "v2-full") == fingerprint("v3", "v3")


@pytest.mark.parametrize("cell", ["oracle-smollm2", "oracle-gemma3", "streaming-smollm2", "streaming-gemma3"])
def test_the_powered_record_repeats_version_2s_oracle_and_streaming_cells_byte_for_byte(cell):
    """These cells have the same items, seeds and shards in both designs, and were made by two libraries
    (v2's and v3's fingerprints): their output tables must be identical, or a library change moved a number.
    (Their config.yaml differ only by the output folder and two keys added since, at their defaults.)"""
    v2, full = _cells("v2", "v2")[cell], _cells("v2-full", "v2-full")[cell]
    assert v2 == full
    old, new = _manifests("v2", cell, v2), _manifests("v2-full", cell, full)
    for a, b in zip(old, new):
        assert a["code_fingerprint"] != b["code_fingerprint"]
        for table in ("items.parquet", "steps.parquet"):
            assert a["outputs_sha256"][table] == b["outputs_sha256"][table], (cell, table)


@pytest.mark.parametrize("cell", ["oracle-smollm2", "oracle-gemma3"])
def test_amendment_4s_powered_record_repeats_study_v4s_oracle_cells_byte_for_byte(cell):
    """Study v4-full's oracle cells are study v4's (design.yaml gives both designs the same oracle items, seeds and
    shard): their step tables must be identical. Their item tables are identical too when one library made both;
    v4 was remade after the item summaries moved to the stored float32 step rows (docs/studies/v4.md), which
    changes item tables only, never step rows."""
    v4, full = _cells("v4", "v4")[cell], _cells("v4-full", "v4-full")[cell]
    assert v4 == full
    old, new = _manifests("v4", cell, v4), _manifests("v4-full", cell, full)
    for a, b in zip(old, new):
        same_library = a["code_fingerprint"] == b["code_fingerprint"]
        tables = ("items.parquet", "steps.parquet") if same_library else ("steps.parquet",)
        for table in tables:
            assert a["outputs_sha256"][table] == b["outputs_sha256"][table], (cell, table)


def test_the_current_study_is_its_design_made_by_one_clean_library():
    """The default scale's current study (v5 today, read from the scale) runs one cell per (kind, model,
    configuration) over the same items, so its claims count items, not cells: C1 and C2 the question-aware items of
    one configuration, C3 the oracle items, C7 the streaming items, each as its design.yaml's counts give them."""
    scales = scales_folder(ROOT)
    study = current_study(scales)
    design_file, key = design_reference(scales, "default", study)
    counts = yaml.safe_load(design_file.read_text())[key.split(".")[0]]["counts"]
    fingerprints = set()
    for name, cell in _cells("default", study).items():
        manifests = _manifests(study, name, cell)
        assert sum(m["n_shard_items"] for m in manifests) == _n_items(cell), name
        assert not any(m["source"]["dirty"] for m in manifests), name
        fingerprints |= {m["code_fingerprint"] for m in manifests}
        kind, model = name.split("-")[:2]
        assert _n_items(cell) == counts[f"{kind}-{model}"], name
    assert len(fingerprints) == 1, f"study {study} was made by {len(fingerprints)} libraries"
    counted = {c: json.loads((ROOT / "results" / study / "claims" / f"{c}.json").read_text())["n"]
               for c in ("c1", "c2", "c3", "c7")}
    per_kind = {kind: sum(n for cell, n in counts.items() if cell.startswith(kind + "-"))
                for kind in ("qa", "oracle", "streaming")}
    assert counted == {"c1": per_kind["qa"], "c2": per_kind["qa"], "c3": per_kind["oracle"],
                       "c7": per_kind["streaming"]}

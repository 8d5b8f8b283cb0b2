"""Amendment 3 resizes amendment 2's 90-minute design by the cell times version 2's committed manifests
measured, and draws fresh items. The resize script must give the locked design from the committed
manifests; the default scale must run it on the amendment's items seeds, with amendment 2's cell
configurations otherwise unchanged."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import yaml

from kvcert.analysis import prereg
from kvcert.scales import load_scale, scales_folder, studies

ROOT = prereg.find_root(__file__)
SCRIPT = ROOT / "workflow" / "scripts" / "resize_design.py"


def _scale(name: str) -> dict:
    return yaml.safe_load((scales_folder(ROOT) / f"{name}.yaml").read_text())


def test_the_resize_rule_gives_the_locked_design_from_the_committed_manifests(tmp_path):
    locked = yaml.safe_load((ROOT / "preregistration" / "amendment-3" / "design.yaml").read_text())
    inputs = locked["inputs"]
    out = tmp_path / "design.yaml"
    subprocess.run([sys.executable, str(SCRIPT), "--cells", str(ROOT / inputs["cells"]),
                    "--budget-minutes", str(inputs["budget_minutes"]), "--cores", str(inputs["cores"]),
                    "--keep", *inputs["keep"], "--out", str(out)], check=True, capture_output=True, text=True)
    again = yaml.safe_load(out.read_text())
    for key in ("factor", "counts", "estimated_cell_seconds", "budget_cell_seconds", "measured"):
        assert again[key] == locked[key], key
    amendment = prereg.load_amendment(ROOT, 3)
    size = amendment["changes"]["design_size"]
    assert size["factor"] == locked["factor"] and size["estimated_cell_seconds"] == locked["estimated_cell_seconds"]
    assert locked["estimated_cell_seconds"] <= locked["budget_cell_seconds"]
    for model, counts in amendment["design"]["reproduce_90_minutes"].items():
        if model == "pooled":
            continue
        for kind, prefix in (("question_aware", "qa"), ("streaming", "streaming"), ("oracle", "oracle")):
            assert counts[kind] == locked["counts"][f"{prefix}-{model}"], (model, kind)


def test_the_rule_scales_only_the_cells_it_does_not_keep_and_fits_the_budget(tmp_path):
    """Our own logic on made-up manifests: the median per-item time, the kept cells, the floor."""
    spec = importlib.util.spec_from_file_location("resize_design", SCRIPT)
    resize_design = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resize_design)
    cells = tmp_path / "cells"
    for cell, shards in {"qa-a": [(10, 100.0), (10, 300.0), (10, 120.0)], "oracle-a": [(5, 250.0)]}.items():
        for k, (n, seconds) in enumerate(shards):
            d = cells / cell / f"shard-{k}"
            d.mkdir(parents=True)
            (d / "manifest.json").write_text(json.dumps({"n_shard_items": n, "wall_seconds": {"total": seconds}}))
    measured = resize_design.measured(cells)
    # per-item times of qa-a's shards: 100/10, 300/10, 120/10 s; their median 12 s, over 10 + 10 + 10 items
    assert measured["qa-a"]["per_item_median"] == pytest.approx(12.0) and measured["qa-a"]["items"] == 30
    # the kept oracle cell's 250 s plus 15 of qa-a's 30 items at 12 s: qa-a halved
    out = resize_design.resize(measured, budget_seconds=250.0 + 12.0 * 15, keep=("oracle",))
    assert out["counts"] == {"oracle-a": 5, "qa-a": 15} and out["factor"] == pytest.approx(0.5)
    assert resize_design.resize(measured, budget_seconds=1e9, keep=("oracle",))["counts"]["qa-a"] == 30  # never grows
    with pytest.raises(SystemExit, match="kept cells alone"):
        resize_design.resize(measured, budget_seconds=100.0, keep=("oracle",))


def test_the_v3_scale_is_amendment_2s_design_resized_on_fresh_items():
    """Scale v3 (`make reproduce-v3`; the default scale until amendment 4, which reads it as a record)."""
    scale = _scale("v3")["studies"]
    assert scale["v1"] == {"prereg": 1, "archived": True} and scale["v2"] == {"prereg": 2, "archived": True}
    assert scale["v2-full"] == {"prereg": 2, "archived": True}  # make reproduce-full's record, tabulated beside
    assert _scale("default")["studies"]["v3"] == {"prereg": 3, "archived": True}
    # both studies' cells as the workflow resolves them (from amendment 2's cell template and the locked counts)
    v2 = studies(load_scale("v2", scales_folder(ROOT)))["v2"]
    v3 = studies(load_scale("v3", scales_folder(ROOT)))["v3"]
    locked = yaml.safe_load((ROOT / "preregistration" / "amendment-3" / "design.yaml").read_text())["counts"]
    assert v3["prereg"] == 3 and sorted(v3["cells"]) == sorted(v2["cells"]) == sorted(locked)
    for name, cell in v3["cells"].items():
        assert f"n_items={locked[name]}" in cell["overrides"], name
        old = v2["cells"][name]
        assert (cell["model"], cell["shards"]) == (old["model"], old["shards"])
        strip = lambda overrides: [o for o in overrides if not o.startswith(("n_items=", "data.seed="))]
        assert strip(cell["overrides"]) == strip(old["overrides"]), name
        seeds = [o for o in cell["overrides"] if o.startswith("data.seed=")]
        # amendment-3.yaml, items_seed: 10 for the question-aware and streaming cells, 11 for the oracle cells
        assert seeds == (["data.seed=11"] if name.startswith("oracle") else ["data.seed=10"]), name


def test_amendment_3_is_locked_over_amendment_2_and_renders():
    prereg.verify_lock(ROOT, 3)
    assert set(prereg.version(2, ROOT).files) < set(prereg.version(3, ROOT).files)
    third = prereg.version(3, ROOT)
    assert (ROOT / third.rendered).read_text() == prereg.render_amendment(prereg.load_amendment(ROOT, 3), 3, third.document)
    assert "## Timing" in (ROOT / third.rendered).read_text()

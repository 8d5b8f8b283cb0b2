"""End to end: ``python -m kvcert.analysis.cli`` on a synthetic cell dir, and the aggregate tables.

The cell tables are synthetic (our own generator, exact runner schema); this tests the plumbing:
lock check, input checks, JSON + figures, one-line errors, no stray Hydra output directories.
"""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcert.analysis import aggregate, cli, synthetic
from kvcert.analysis.errors import AnalysisError, PreregistrationError

from helpers.prereg import locked_copy

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = locked_copy(tmp_path_factory.mktemp("claimrun"))
    synthetic.write_cell(tmp / "cells" / "qa", synthetic.SynthSpec(n_items=40, settings=("question_aware",)))
    synthetic.write_cell(tmp / "cells" / "st", synthetic.SynthSpec(n_items=40, settings=("streaming",), seed=1))
    return tmp


def claim_cli(work, *overrides):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kvcert.analysis.cli", *overrides, f"prereg_root={work}",
                           "n_boot=200"], cwd=work, env=env, capture_output=True, text=True, timeout=120)


def test_claim_cli_end_to_end(work):
    out = work / "results" / "claims" / "c7.json"
    proc = claim_cli(work, "claim=c7", f"cells=[{work / 'cells' / 'st'}]", f"out={out}", f"figure_dir={work / 'figs'}")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    for key in ("claim", "estimate", "ci_low", "ci_high", "threshold", "verdict", "paper_verdict", "agrees", "n"):
        assert key in res
    assert (work / "figs" / "c7.png").stat().st_size > 0 and (work / "figs" / "c7.pdf").is_file()
    assert not (work / "outputs").exists() and not (work / ".hydra").exists()


def test_claim_cli_missing_input_is_one_line_and_writes_nothing(work):
    out = work / "nothing.json"
    proc = claim_cli(work, "claim=c4", f"cells=[{work / 'cells' / 'qa'},{work / 'cells' / 'absent'}]", f"out={out}")
    assert proc.returncode == cli.EXIT_BAD_INPUT
    assert proc.stderr.strip().splitlines()[-1] == f"kvcert-claim: error: {work / 'cells' / 'absent'}: missing cell directory"
    assert not out.exists()


def config(work, **kw):
    return {"claim": "c3", "cells": [str(work / "cells" / "qa")], "out": str(work / "r" / "c.json"),
            "figure_dir": str(work / "figs"), "prereg_root": str(work), "n_boot": 100, **kw}


def test_run_in_process_writes_json_and_figures(work):
    res = cli.run(config(work, out=str(work / "r" / "c3.json")))
    assert res.claim == "c3" and json.loads((work / "r" / "c3.json").read_text())["verdict"] == res.verdict
    assert (work / "figs" / "c3.pdf").is_file()


def test_run_refuses_without_matching_lock(work, tmp_path):
    shutil.copytree(work / "preregistration", tmp_path / "preregistration")
    shutil.copytree(work / "src", tmp_path / "src")
    claims_yaml = tmp_path / "preregistration" / "claims.yaml"
    claims_yaml.write_text(claims_yaml.read_text().replace("threshold: -2.0", "threshold: -5.0"))
    out = tmp_path / "c1.json"
    with pytest.raises(PreregistrationError, match="claims.yaml changed since the lock"):
        cli.run(config(work, claim="c1", out=str(out), prereg_root=str(tmp_path)))
    (tmp_path / "preregistration" / "prereg.lock").unlink()
    with pytest.raises(PreregistrationError, match="prereg.lock is missing"):
        cli.run(config(work, claim="c1", out=str(out), prereg_root=str(tmp_path)))
    assert not out.exists()


def test_run_population_missing_names_it(work):
    with pytest.raises(AnalysisError, match="no rows with setting=streaming"):
        cli.run(config(work, claim="c7", out=str(work / "x.json")))
    assert not (work / "x.json").exists()


def test_aggregate_writes_all_columns(work, tmp_path):
    from kvcert.analysis import claims as claims_mod
    import yaml
    doc = yaml.safe_load((ROOT / "preregistration" / "claims.yaml").read_text())
    specs = {c["id"]: c for c in doc["claims"]}
    items, steps = synthetic.make_tables(synthetic.SynthSpec(n_items=40))
    for cid in sorted(specs):
        res = claims_mod.run_claim(cid, claims_mod.Tables(items, steps), specs[cid], doc["conventions"],
                                   claims_mod.options_for(specs[cid], doc["conventions"], n_boot=100))
        (tmp_path / f"{cid}.json").write_text(json.dumps(res.to_dict()))
    assert aggregate.main(["--claims-dir", str(tmp_path), "--out-dir", str(tmp_path / "tables")]) == 0
    with open(tmp_path / "tables" / "claims.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 7 and set(aggregate.CLAIM_COLUMNS) <= set(rows[0])
    with open(tmp_path / "tables" / "reproduction.csv") as f:
        repro = list(csv.DictReader(f))
    assert list(repro[0]) == aggregate.REPRO_COLUMNS and len(repro) == len(aggregate.REPRODUCTION)
    assert all(r["ours"] != "" for r in repro)
    assert "\\toprule" in (tmp_path / "tables" / "claims.tex").read_text()
    assert (tmp_path / "tables" / "claims.md").read_text().startswith("| study | prereg | claim |")


def test_cells_of_different_code_are_refused_unless_allowed(work, tmp_path):
    """A claim pools cells only when their manifests name one code fingerprint (or none at all)."""
    cells = []
    for name, fingerprint in (("a", "a" * 64), ("b", "b" * 64)):
        cell = tmp_path / name
        shutil.copytree(work / "cells" / "qa", cell)
        (cell / "manifest.json").write_text(json.dumps({"code_fingerprint": fingerprint}))
        cells.append(str(cell))
    out = tmp_path / "c4.json"
    proc = claim_cli(work, "claim=c4", f"cells=[{','.join(cells)}]", f"out={out}", "figures=false")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == cli.EXIT_BAD_INPUT and "2 different codes" in last and "aaaaaaaaaaaa" in last, last
    assert "bbbbbbbbbbbb" in last and "allow_mixed_code=true" in last and not out.exists()
    proc = claim_cli(work, "claim=c4", f"cells=[{','.join(cells)}]", f"out={out}", "figures=false",
                     "allow_mixed_code=true")
    assert proc.returncode == 0, proc.stderr
    provenance = json.loads(out.read_text())["details"]["provenance"]
    assert provenance["cell_code_fingerprints"] == {cells[0]: "a" * 64, cells[1]: "b" * 64}
    assert provenance["allow_mixed_code"] is True and len(provenance["analysis_fingerprint"]) == 64

"""The Snakemake DAG: dry-runs of every scale, bad scales, and the smoke scale end to end (real jobs).

The end-to-end test runs the real pipeline (SmolLM2, kvcert-run, kvcert-claim, notebooks) on the smoke
scale into a temporary output folder; it takes a few minutes on 2 cores.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
CLAIM_COLUMNS = ["claim", "estimate", "ci_low", "ci_high", "threshold", "verdict", "paper_verdict", "agrees"]


def snakemake(*args, timeout=1800):
    return subprocess.run(
        [str(BIN / "snakemake"), *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("scale", ["smoke", "default", "paper", "rehearse"])
def test_dry_run_is_clean(scale):
    proc = snakemake("-n", "--quiet", "rules", "--config", f"scale={scale}", "outdir=results/dryrun-" + scale)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cell" in proc.stdout + proc.stderr


def test_unknown_scale_is_one_clear_line():
    proc = snakemake("-n", "--config", "scale=huge")
    assert proc.returncode != 0
    assert "--config scale=huge: unknown scale; known: default, paper, rehearse, smoke" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.smollm2
def test_smoke_dag_end_to_end(tmp_path):
    # The canonical smoke folder (git-ignored), rebuilt from scratch; kept afterwards so that
    # `make test-slurm` can compare the SLURM run's claims with it.
    out = "results/smoke"
    shutil.rmtree(ROOT / out, ignore_errors=True)
    proc = snakemake("--cores", "2", "--config", "scale=smoke", f"outdir={out}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    claims = pd.read_csv(ROOT / out / "claims.csv")
    assert sorted(claims["claim"]) == [f"c{i}" for i in range(1, 8)]
    for column in CLAIM_COLUMNS:
        assert column in claims.columns
    assert set(claims["verdict"]) <= {"supported", "not supported", "inconclusive"}
    figures = sorted((ROOT / out / "figures").glob("*.png"))
    assert len(figures) >= 5
    for name in ("claims.md", "claims.tex", "reproduction.csv"):
        assert (ROOT / out / name).stat().st_size > 0
    executed = json.loads((ROOT / out / "notebooks" / "claims.ipynb").read_text())
    assert any(cell.get("outputs") for cell in executed["cells"] if cell["cell_type"] == "code")
    # A finished DAG is up to date: a rerun schedules nothing.
    again = snakemake("-n", "--config", "scale=smoke", f"outdir={out}")
    assert "Nothing to be done" in again.stdout + again.stderr
    report = snakemake("--report", str(tmp_path / "report.html"), "--config", "scale=smoke", f"outdir={out}")
    assert report.returncode == 0, report.stderr[-2000:]
    assert (tmp_path / "report.html").stat().st_size > 10_000

"""workflow/slurm/controller.sbatch's own logic, without a cluster (the real run: tests/test_slurm_preemption.py).

Stand-ins first on PATH (this test is about the script's decisions, not SLURM's): ``squeue`` prints a fixed job
list, ``scancel`` and ``snakemake`` record how they were called. The script must cancel exactly the jobs of
snakemake's (comment rule_* or group_*) in its own directory other than itself, unlock before running, pass its
arguments through with --rerun-incomplete, exit with snakemake's status, and refuse a bad setting in one line.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "workflow" / "slurm" / "controller.sbatch"


@pytest.fixture
def site(tmp_path):
    """A run directory with a profile, and stand-in SLURM tools and snakemake; returns (run dir, env, calls file)."""
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    (run / "profile" / "config.yaml").write_text("executor: slurm\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    jobs = "\n".join([
        f"7|{run}|kvcert-controller",          # this controller itself
        f"11|{run}|rule_cell_wildcards_x",     # a cell job left behind here: cancel
        f"12|{run}|group_cells_abc",           # a group job left behind here: cancel
        f"13|{tmp_path / 'elsewhere'}|rule_cell_y",  # another directory's: keep
        f"14|{run}|my-own-job",                # not snakemake's: keep
    ])
    # squeue lists the jobs until scancel ran (then nothing is left)
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n[ -f '{tmp_path}/cancelled' ] || printf '%s\\n' '{jobs}'\n")
    (bin_dir / "scancel").write_text(f"#!/bin/sh\necho \"scancel $*\" >> '{calls}'\ntouch '{tmp_path}/cancelled'\n")
    (bin_dir / "snakemake").write_text(f"#!/bin/sh\necho \"snakemake $*\" >> '{calls}'\nexit ${{FAKE_RC:-0}}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "KVCERT_CONTROLLER_PROFILE": "profile"}
    env.pop("SNAKEMAKE", None)
    return run, env, calls


def _controller(run: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=run, env=env, capture_output=True, text=True, timeout=60)


def test_cancels_only_snakemakes_jobs_left_here_then_unlocks_and_runs(site):
    run, env, calls = site
    done = _controller(run, env, "--config", "scale=paper")
    assert done.returncode == 0, done.stderr
    assert calls.read_text().splitlines() == [
        "scancel 11 12",
        "snakemake --workflow-profile profile --unlock --config scale=paper",
        "snakemake --workflow-profile profile --rerun-incomplete --config scale=paper",
    ]
    assert "cancelling jobs an earlier controller left running: 11 12" in done.stderr
    assert "job 7 (start 1)" in done.stderr and "snakemake exited with 0" in done.stderr


def test_exits_with_snakemakes_status(site):
    run, env, calls = site
    done = _controller(run, {**env, "FAKE_RC": "3"}, "--config", "scale=paper")
    assert done.returncode == 3 and "snakemake exited with 3" in done.stderr


@pytest.mark.parametrize("change, expected", [
    ({"KVCERT_CONTROLLER_ORPHANS": "kill"}, "KVCERT_CONTROLLER_ORPHANS=kill: expected cancel or wait"),
    ({"KVCERT_CONTROLLER_PROFILE": "no/such/profile"}, "no profile no/such/profile/config.yaml here"),
    ({"SNAKEMAKE": "no-such-snakemake"}, "no-such-snakemake not found"),
])
def test_a_bad_setting_is_one_line_and_runs_nothing(site, change, expected):
    run, env, calls = site
    done = _controller(run, {**env, **change})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert not calls.exists(), "nothing may be cancelled or run"

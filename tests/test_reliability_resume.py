"""Issue #6: a cell killed with SIGKILL resumes to the complete table; an interrupted DAG completes on rerun.

Both for real: a subprocess, a real SIGKILL while it is working, then a rerun.

* Cell: ``kvcert-run`` with n_items=4; as soon as one item's checkpoint exists under out_dir/.parts the
  process is SIGKILLed. The rerun must skip the finished item (its checkpoint is not rewritten) and give
  exactly the rows of an uninterrupted run, no duplicates on (item_id, policy, design, budget, seed,
  setting), equal to the uninterrupted run's tables.
* DAG: the workflow (a copy, with a three-shard scale of tiny cells) runs the cell targets; snakemake and
  its job are SIGKILLed (the whole process group) after the first cell finished. ``snakemake --unlock``
  then ``--rerun-incomplete`` completes the DAG without rewriting the finished cell's files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from kvcert.runner import cli
from kvcert.scales import scales_folder

KEYS = ["item_id", "policy", "design", "budget", "seed", "setting"]
CELL = ["progress=false", "threads=1", "data=ruler", "data.context_tokens=200", "+data.max_new_tokens=3",
        "n_items=4", "policies=[snapkv]", "designs=[topk,poisson]", "budgets=[0.5]", "seeds=[0,1]"]
N_CONFIGURATIONS = 4  # full, snapkv/topk, snapkv/poisson seeds 0 and 1
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "TOKENIZERS_PARALLELISM": "false"}


def _wait_for(predicate, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out = proc.stderr.read() if proc.stderr else "(see the log)"
            raise AssertionError(f"the process ended (rc={proc.returncode}) before {what}:\n{out[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _kvcert_run() -> list[str]:
    script = BIN / "kvcert-run"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvcert.runner.cli"]


@pytest.mark.smollm2
@pytest.mark.slow  # make test-full: keeps make test near 12 minutes
def test_cell_killed_with_sigkill_resumes_to_the_uninterrupted_table(tmp_path, capsys):
    reference = tmp_path / "reference"
    assert cli.main([*CELL, f"out_dir={reference}"]) == 0, capsys.readouterr().err

    out_dir = tmp_path / "killed"
    parts = out_dir / ".parts"
    proc = subprocess.Popen(_kvcert_run() + [*CELL, f"out_dir={out_dir}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        _wait_for(lambda: any(parts.glob("*.items.parquet")), proc, 300, "the first item checkpoint")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    finished = sorted(parts.glob("*.items.parquet"))
    assert 1 <= len(finished) < 4, "the kill came too late to test a resume"
    assert not (out_dir / "items.parquet").exists() and not (out_dir / "steps.parquet").exists()

    reads = []
    original = pd.read_parquet

    def spy(path, *args, **kwargs):  # the rerun reads the finished checkpoints instead of recomputing them
        reads.append(Path(path))
        return original(path, *args, **kwargs)

    pd.read_parquet = spy
    try:
        rc = cli.main([*CELL, f"out_dir={out_dir}"])
    finally:
        pd.read_parquet = original
    assert rc == 0, capsys.readouterr().err
    assert all(p in reads for p in finished), "finished items were recomputed instead of read back"
    # what decided each finished item's answers is read back with it (kvcert.runner.decisions)
    assert all(p.with_name(p.name.replace(".items.", ".decisions.")) in reads for p in finished)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["n_resumed_items"] == len(finished)
    assert not parts.exists(), "a complete cell keeps no checkpoints"

    items = pd.read_parquet(out_dir / "items.parquet")
    assert len(items) == 4 * N_CONFIGURATIONS
    assert not items.duplicated(KEYS).any()
    pd.testing.assert_frame_equal(items, pd.read_parquet(reference / "items.parquet"))
    steps = pd.read_parquet(out_dir / "steps.parquet")
    assert not steps.duplicated([*KEYS, "step", "layer", "kv_head"]).any()
    pd.testing.assert_frame_equal(steps, pd.read_parquet(reference / "steps.parquet"))
    pd.testing.assert_frame_equal(pd.read_parquet(out_dir / "decisions.parquet"),
                                  pd.read_parquet(reference / "decisions.parquet"))


TINY_SCALE = """\
# Three shards of a tiny cell: the reliability test of an interrupted DAG.
outdir: results/resume
figure_dir: results/resume/figures
threads_per_cell: 1
models:
  smollm2: [model=smollm2]
cells:
  qa:
    model: smollm2
    shards: 3
    overrides: [data=ruler, data.context_tokens=200, +data.max_new_tokens=2, n_items=3, 'policies=[snapkv]',
                'designs=[poisson]', 'budgets=[0.5]', 'seeds=[0]']
"""


@pytest.mark.slow
@pytest.mark.smollm2
def test_dag_interrupted_completes_on_rerun_without_recomputing(tmp_path):
    from test_reliability_pipeline_inputs import copy_workflow, snakemake

    repo = copy_workflow(tmp_path / "repo")
    (scales_folder(repo) / "resume.yaml").write_text(TINY_SCALE)
    shards = [repo / "results" / "resume" / "v1" / "cells" / "qa" / f"shard-{i}" for i in range(3)]
    targets = [str(s.relative_to(repo) / "items.parquet") for s in shards]
    command = [str(BIN / "snakemake"), "--cores", "1", *targets, "--config", "scale=resume"]
    log = tmp_path / "snakemake.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(command, cwd=repo, env=ENV, stdout=handle, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    def recorded_cells() -> list[Path]:
        """Shards whose job snakemake has recorded as finished (not only: whose outputs exist)."""
        text = log.read_text()
        outputs = dict(re.findall(r"output: (\S+)/items\.parquet.*?\n(?:    .*\n)*?    jobid: (\d+)", text))
        jobs = {job: out for out, job in outputs.items()}
        done = re.findall(r"^Finished jobid: (\d+) \(Rule: cell\)", text, flags=re.M)
        return [repo / jobs[j] for j in done if j in jobs]

    def one_cell_recorded() -> bool:
        return bool(recorded_cells())

    try:
        _wait_for(one_cell_recorded, proc, 600, "the first finished cell")
        os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its running job
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    finished = recorded_cells()
    assert 1 <= len(finished) < 3, "the kill came too late to test a rerun"
    files = [f for s in finished for f in (s / "items.parquet", s / "steps.parquet", s / "manifest.json")]
    stamps = {f: f.stat().st_mtime_ns for f in files}

    unlock = snakemake(repo, "--unlock", *targets, "--config", "scale=resume")
    assert unlock.returncode == 0, unlock.stderr[-2000:]
    plan = snakemake(repo, "-n", "--rerun-incomplete", *targets, "--config", "scale=resume")
    assert plan.returncode == 0, plan.stderr[-2000:]
    scheduled = "\n".join(line for line in (plan.stdout + plan.stderr).splitlines() if line.strip().startswith("output:"))
    assert "items.parquet" in scheduled, plan.stdout + plan.stderr
    for s in finished:
        assert f"{s.relative_to(repo)}/items.parquet" not in scheduled, f"a finished cell is rescheduled: {scheduled}"
    rerun = snakemake(repo, "--cores", "1", "--rerun-incomplete", *targets, "--config", "scale=resume")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert {f: f.stat().st_mtime_ns for f in files} == stamps, "finished cells were rewritten"
    for s in shards:
        items = pd.read_parquet(s / "items.parquet")
        assert len(items) == 2 and not items.duplicated(KEYS).any()  # 1 item x (full, snapkv/poisson)
    again = snakemake(repo, "-n", *targets, "--config", "scale=resume")
    assert "Nothing to be done" in again.stdout + again.stderr
    shutil.rmtree(repo / "results", ignore_errors=True)

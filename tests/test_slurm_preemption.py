"""Issue 57 (preemption): a cell job requeued by SLURM mid-shard, and a controller job stopped near its time limit,
both end in the tables of an uninterrupted run, byte for byte.

On a private one-node SLURM cluster (workflow/slurm/cluster-up.sh in a temporary state dir on free loopback
ports, /etc/slurm untouched), snakemake runs one shard of a tiny SmolLM2 cell through the test profile
(workflow/profiles/slurm-local, which submits with --requeue as profiles/slurm does).

* Requeue: as soon as the cell has checkpointed its first item, the test reads the job id from the shard's lock
  file (the holder's record) and requeues the job (``scontrol requeue``: SLURM kills it and queues it again under
  the same id, as preemption with PreemptMode=REQUEUE does), then lets it start at once instead of after SLURM's
  2-minute begin time. The same snakemake must finish without resubmitting.
* Controller: workflow/slurm/controller.sbatch runs snakemake as a SLURM job; once the cell has checkpointed an
  item, the controller gets the signal SLURM sends ten minutes before its time limit (SIGUSR1 to the batch shell):
  it interrupts snakemake, which cancels the cell job, and requeues itself; its next start cancels a job of
  snakemake's that a hard-killed controller would have left in the directory (a stand-in: sleep), unlocks and
  reruns the incomplete cell, which resumes.

Either way the shard's items.parquet and steps.parquet must equal an uninterrupted run's (kvcert-run), with the
checkpointed items read back rather than recomputed (manifest n_resumed_items), no duplicate row and nothing left
behind (.parts, .lock). All runs import the package from a copy taken when the module starts (PYTHONPATH), so
that they run the same code even in a checkout edited meanwhile: a resumed run refuses checkpoints of other code,
as it should, and that is tests/test_reliability_resume.py's concern, not this one's.
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

from test_reliability_pipeline_inputs import copy_workflow
from test_slurm_cluster import _free_port, _reason, _run

from kvcert.scales import cell_overrides, load_scale, scales_folder

pytestmark = [pytest.mark.slurm, pytest.mark.smollm2, pytest.mark.timeout(600)]
if _reason:
    pytestmark.append(pytest.mark.skip(reason=_reason))

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
KEYS = ["item_id", "policy", "design", "budget", "seed", "setting"]
SCALE = """\
# One shard of a tiny SmolLM2 cell: the SLURM preemption test (tests/test_slurm_preemption.py).
outdir: results/preempt
figure_dir: results/preempt/figures
campaign: true
threads_per_cell: 1
models:
  smollm2: [model=smollm2]
cells:
  qa:
    model: smollm2
    shards: 1
    overrides: [data=ruler, data.context_tokens=300, +data.max_new_tokens=4, n_items=6, 'policies=[snapkv]',
                'designs=[topk,poisson]', 'budgets=[0.5]', 'seeds=[0,1]']
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A private cluster; yields the environment that reaches it (its client wrappers first on PATH)."""
    state = tmp_path_factory.mktemp("slurm") / "state"
    ctld, slurmd = _free_port(), _free_port()
    while slurmd == ctld:
        slurmd = _free_port()
    env = dict(os.environ, KVCERT_SLURM_DIR=str(state), KVCERT_SLURM_CTLD_PORT=str(ctld),
               KVCERT_SLURM_D_PORT=str(slurmd), KVCERT_SLURM_ETC="0", KVCERT_SLURM_WAIT_S="60")
    env.pop("SLURM_CONF", None)
    up = _run("cluster-up.sh", env, timeout=240)
    if up.returncode != 0 and "apt-get install" in up.stderr:
        pytest.skip(f"could not install slurm/munge: {up.stderr.strip()[-300:]}")
    try:
        assert up.returncode == 0, up.stderr
        env.update(SLURM_CONF=str(state / "etc" / "slurm.conf"), TOKENIZERS_PARALLELISM="false",
                   PATH=f"{state / 'bin'}{os.pathsep}{BIN}{os.pathsep}{env.get('PATH', '')}")
        yield env
    finally:
        down = _run("cluster-down.sh", env, timeout=120)
        assert down.returncode == 0, down.stderr


@pytest.fixture(scope="module")
def package_env(cluster, tmp_path_factory):
    """The cluster's environment with the package imported from a copy of it (see the module's docstring)."""
    package = tmp_path_factory.mktemp("package")
    shutil.copytree(REPO / "src" / "kvcert", package / "kvcert", ignore=shutil.ignore_patterns("__pycache__"))
    return {**cluster, "PYTHONPATH": os.pathsep.join(p for p in (str(package), cluster.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="module")
def reference(package_env, tmp_path_factory) -> Path:
    """The shard as the cell rule runs it, uninterrupted."""
    scale = load_scale("preempt", _scales_with_preempt(tmp_path_factory.mktemp("scales")))
    out = tmp_path_factory.mktemp("reference") / "shard-0"
    done = subprocess.run([sys.executable, "-m", "kvcert.runner.cli", *cell_overrides(scale, scale["cells"]["qa"]),
                           "shard=0", "n_shards=1", "threads=1", "progress=false", f"out_dir={out}"], env=package_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _scales_with_preempt(where: Path) -> Path:
    scales = where / "scales"
    shutil.copytree(scales_folder(REPO), scales)
    (scales / "preempt.yaml").write_text(SCALE)
    return scales


def _workflow(tmp_path: Path) -> tuple[Path, Path]:
    """A runnable copy of the workflow with the preempt scale; (repository, the shard's directory)."""
    repo = copy_workflow(tmp_path / "repo")
    (scales_folder(repo) / "preempt.yaml").write_text(SCALE)
    return repo, repo / "results" / "preempt" / "v1" / "cells" / "qa" / "shard-0"


def _check_resumed(shard: Path, reference: Path, checkpointed: int) -> None:
    manifest = json.loads((shard / "manifest.json").read_text())
    assert manifest["n_resumed_items"] >= checkpointed >= 1, manifest
    assert not (shard / ".parts").exists() and not (shard / ".lock").exists()
    for table in ("items.parquet", "steps.parquet"):
        assert (shard / table).read_bytes() == (reference / table).read_bytes(), f"{table} differs from the uninterrupted run"
    items = pd.read_parquet(shard / "items.parquet")
    assert len(items) == 6 * 4 and not items.duplicated(KEYS).any()


def _scontrol(env: dict, *args: str) -> str:
    done = subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"scontrol {' '.join(args)}: {done.stderr}"
    return done.stdout


def _wait(predicate, proc: subprocess.Popen, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        found = predicate()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"snakemake ended (rc={proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def test_requeued_cell_resumes_to_the_uninterrupted_tables(package_env, reference, tmp_path):
    repo, shard = _workflow(tmp_path)
    log = tmp_path / "snakemake.log"
    command = ["timeout", "-s", "KILL", "540", str(BIN / "snakemake"), "--workflow-profile",
               str(REPO / "workflow" / "profiles" / "slurm-local"), str(shard.relative_to(repo) / "items.parquet"),
               "--config", "scale=preempt"]
    with open(log, "w") as handle:
        proc = subprocess.Popen(command, cwd=repo, env=package_env, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait(lambda: any((shard / ".parts").glob("*.items.parquet")), proc, 300, "the first checkpoint", log)
        holder = json.loads((shard / ".lock").read_text())
        job = holder["slurm_job_id"]
        assert job and re.fullmatch(r"\d+", job), holder
        _scontrol(package_env, "requeue", job)
        checkpointed = len(list((shard / ".parts").glob("*.items.parquet")))
        assert checkpointed < 6, "the requeue came too late to test a resume"
        _wait(lambda: "JobState=PENDING" in _scontrol(package_env, "show", "job", job), proc, 60, "the requeued job", log)
        _scontrol(package_env, "update", f"jobid={job}", "StartTime=now")  # SLURM would start it ~2 minutes later
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    info = _scontrol(package_env, "show", "job", job)
    assert "JobState=COMPLETED" in info and "Restarts=1" in info, info
    assert len(re.findall(r"has been submitted with SLURM jobid", text)) == 1, "snakemake resubmitted instead of waiting"
    _check_resumed(shard, reference, checkpointed)
    # the scale is a campaign: its first run with jobs to do recorded the start (onstart), the jobs did not
    starts = json.loads((repo / "results" / "preempt" / "campaign.json").read_text())["starts"]
    assert len(starts) == 1 and "kvcert workflow: campaign started: results/preempt/campaign.json" in text


def _job_state(env: dict, job: str) -> str:
    found = re.search(r"JobState=(\S+)", _scontrol(env, "show", "job", job))
    return found.group(1) if found else "?"


# Outside CI's tier for now: on 2026-12-06 its second start (after the requeue) exited 1 at once without writing to
# its log in one `make test-slurm` run, where it had passed before; until that is understood it runs with -m long.
@pytest.mark.long
def test_controller_job_stopped_near_its_time_limit_requeues_itself_and_the_cell_resumes(package_env, reference,
                                                                                         tmp_path):
    repo, shard = _workflow(tmp_path)
    log = tmp_path / "controller.log"
    env = {**package_env, "KVCERT_CONTROLLER_PROFILE": str(REPO / "workflow" / "profiles" / "slurm-local"),
           "SNAKEMAKE": str(BIN / "snakemake")}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-p", "debug", "--time=30", f"--output={log}", f"--chdir={repo}",
         str(REPO / "workflow" / "slurm" / "controller.sbatch"), str(shard.relative_to(repo) / "items.parquet"),
         "--config", "scale=preempt"], env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    controller = submitted.stdout.strip().split(";")[0]
    orphan_job = None

    def wait(predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not (found := predicate()):
            state = _job_state(env, controller)
            text = log.read_text() if log.exists() else "(no log yet)"
            assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "COMPLETED"), f"controller {state} before {what}:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{text[-3000:]}"
            time.sleep(0.2)
        return found

    try:
        wait(lambda: any((shard / ".parts").glob("*.items.parquet")), 300, "the first checkpoint")
        cell_job = json.loads((shard / ".lock").read_text())["slurm_job_id"]
        # what SLURM sends ten minutes before the time limit (--signal=B:USR1@600)
        subprocess.run(["scancel", "--batch", "--signal=USR1", controller], env=env, check=True, timeout=30)
        wait(lambda: _job_state(env, controller) == "PENDING", 120, "the controller to requeue itself")
        checkpointed = len(list((shard / ".parts").glob("*.items.parquet")))
        assert checkpointed < 6, "the stop came too late to test a resume"
        assert _job_state(env, cell_job) == "CANCELLED", "the interrupted snakemake left its cell job running"
        # a job of snakemake's in this directory that a controller killed hard would have left running
        orphan = subprocess.run(["sbatch", "--parsable", "-p", "debug", "--mem", "100", "--comment", "rule_cell_orphan",
                                 f"--chdir={repo}", "--output=/dev/null", "--wrap", "sleep 600"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert orphan.returncode == 0, orphan.stderr
        orphan_job = orphan.stdout.strip().split(";")[0]
        _scontrol(env, "update", f"jobid={controller}", "StartTime=now")  # SLURM would start it ~2 minutes later
        deadline = time.monotonic() + 400
        while _job_state(env, controller) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        if _job_state(env, controller) in ("PENDING", "RUNNING", "REQUEUED"):
            subprocess.run(["scancel", controller], env=env, timeout=30)
        if orphan_job and _job_state(env, orphan_job) in ("PENDING", "RUNNING"):
            subprocess.run(["scancel", orphan_job], env=env, timeout=30)
    text = log.read_text()
    info = _scontrol(env, "show", "job", controller)
    assert "JobState=COMPLETED" in info and "Restarts=1" in info, f"{info}\n{text[-3000:]}"
    assert "time limit near: interrupting snakemake" in text and f"requeued job {controller}" in text, text[-3000:]
    assert "(start 2)" in text and "snakemake exited with 0" in text, text[-3000:]
    assert f"cancelling jobs an earlier controller left running: {orphan_job}" in text, text[-3000:]
    assert _job_state(env, orphan_job) == "CANCELLED"
    _check_resumed(shard, reference, checkpointed)

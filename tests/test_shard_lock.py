"""Issue 57 (preemption): two writers of one shard cannot both write.

The holder is a real second process (``python -c`` holding ``kvcert.runner.shard_lock.shard_lock`` on a shard
directory); the refused writer is ``kvcert-run`` itself (``kvcert.runner.cli.main`` in this process, the console
script's code path), which must end with one line naming the shard and the holder, exit non-zero and write
nothing, before it loads the model. A holder killed with SIGKILL leaves its lock file, which the next writer takes
over. No model is loaded: the lock is taken before anything heavy (a run that got past it would fail on the
bogus model and say so, which the assertions would catch).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcert.runner import cli
from kvcert.runner.shard_lock import LOCK_NAME, ShardBusy, shard_lock

CELL = ["progress=false", "threads=1", "data=ruler", "data.context_tokens=200", "+data.max_new_tokens=2", "n_items=2",
        "policies=[snapkv]", "designs=[poisson]", "budgets=[0.5]", "seeds=[0]"]
HOLDER = """
import sys, time
from kvcert.runner.shard_lock import shard_lock
with shard_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def _hold(out_dir: Path, env: dict | None = None) -> subprocess.Popen:
    """A second process holding ``out_dir``'s lock (returns once it holds it)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    line = proc.stdout.readline()
    assert line.strip() == "held", f"the holder did not take the lock (rc={proc.poll()})"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_second_writer_of_a_shard_exits_naming_the_holder_and_writes_nothing(tmp_path, capsys):
    shard = tmp_path / "cells" / "qa" / "shard-0"
    holder = _hold(shard, {"SLURM_JOB_ID": "4242"})
    try:
        record = (shard / LOCK_NAME).read_text()
        rc = cli.main([*CELL, f"out_dir={shard}"])
        err = capsys.readouterr().err.strip().splitlines()
    finally:
        _stop(holder)
    assert rc == 2
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("kvcert-run: error: ") and f"out_dir={shard}" in line, line
    assert "another run is writing this shard" in line, line
    assert f"host {socket.gethostname()}" in line and f"pid {holder.pid}" in line and "SLURM job 4242" in line, line
    assert "scancel 4242" in line, line
    # nothing written beside the holder's lock file, which is untouched
    assert sorted(p.name for p in shard.iterdir()) == [LOCK_NAME]
    assert (shard / LOCK_NAME).read_text() == record


def test_lock_of_a_killed_holder_is_taken_over(tmp_path):
    shard = tmp_path / "shard-0"
    holder = _hold(shard)
    with pytest.raises(ShardBusy, match=f"pid {holder.pid}.*kill {holder.pid} on "):
        with shard_lock(shard):
            pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    stale = json.loads((shard / LOCK_NAME).read_text())
    assert stale["pid"] == holder.pid and stale["slurm_job_id"] is None  # the dead holder's record is still there
    with shard_lock(shard) as path:
        mine = json.loads(path.read_text())
        assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
        # while held, this process cannot take it a second time either
        with pytest.raises(ShardBusy, match="in this process"):
            with shard_lock(shard):
                pass
    assert not (shard / LOCK_NAME).exists(), "a normal end removes the lock file"
    assert shard.is_dir(), "a directory that existed before is kept"


def test_lock_removes_only_the_directories_it_created_and_left_empty(tmp_path):
    shard = tmp_path / "new" / "shard-0"
    with shard_lock(shard):
        assert (shard / LOCK_NAME).is_file()
    assert not (tmp_path / "new").exists(), "a refused or failed run must leave no empty directories"
    with shard_lock(shard):
        (shard / "items.parquet").write_text("x")
    assert sorted(p.name for p in shard.iterdir()) == ["items.parquet"]


def test_a_released_lock_is_free_again_for_another_process(tmp_path):
    shard = tmp_path / "shard-0"
    with shard_lock(shard):
        pass
    holder = _hold(shard)  # a fresh process gets it after this one released it
    try:
        assert json.loads((shard / LOCK_NAME).read_text())["pid"] == holder.pid
    finally:
        _stop(holder)


def test_the_lock_costs_a_normal_run_nothing_measurable(tmp_path):
    shard = tmp_path / "shard-0"
    shard.mkdir()
    start = time.perf_counter()
    for _ in range(200):
        with shard_lock(shard):
            pass
    per_lock = (time.perf_counter() - start) / 200
    assert per_lock < 0.01, f"{per_lock * 1e3:.2f} ms per lock and release"

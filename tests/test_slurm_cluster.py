"""The private one-node SLURM cluster of workflow/slurm/: up -> sbatch job -> down, nothing left.

Runs a separate cluster in a temporary state dir on free loopback ports and never touches
/etc/slurm (KVCERT_SLURM_ETC=0), so it does not disturb a cluster that is already up.
Needs root (slurmd runs as root) and either the Debian slurm/munge packages or apt-get.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "workflow" / "slurm"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the local SLURM cluster needs Linux"
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurmd runs as root)"
    if not all(shutil.which(b) or shutil.which(b, path="/usr/sbin:/usr/bin") for b in DAEMONS):
        if shutil.which("apt-get") is None:
            return "slurm/munge not installed and no apt-get to install them"
    return None


_reason = _skip_reason()
if _reason:
    pytestmark.append(pytest.mark.skip(reason=_reason))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    state = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("State:")), "")
    return state not in ("Z", "X")


def _listening_addrs(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) listening on PORT."""
    addrs = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            local, st = f[1], f[3]
            addr, p = local.rsplit(":", 1)
            if st == "0A" and int(p, 16) == port:
                addrs.add(addr)
    return addrs


def _run(script: str, env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPTS / script)], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_cluster_up_job_down(tmp_path):
    state = tmp_path / "slurm"
    ctld_port, d_port = _free_port(), _free_port()
    while d_port == ctld_port:
        d_port = _free_port()
    env = dict(
        os.environ,
        KVCERT_SLURM_DIR=str(state),
        KVCERT_SLURM_CTLD_PORT=str(ctld_port),
        KVCERT_SLURM_D_PORT=str(d_port),
        KVCERT_SLURM_ETC="0",
        KVCERT_SLURM_WAIT_S="60",
    )
    env.pop("SLURM_CONF", None)
    pids_file = state / "run" / "started.pids"
    pids: list[int] = []
    try:
        up = _run("cluster-up.sh", env, timeout=240)
        if up.returncode != 0 and "apt-get install" in up.stderr:
            pytest.skip(f"could not install slurm/munge: {up.stderr.strip()[-300:]}")
        assert up.returncode == 0, up.stderr
        env_sh = Path(up.stdout.strip().splitlines()[-1])
        assert env_sh == state / "env.sh" and env_sh.is_file()
        pids = [int(ln.split()[1]) for ln in pids_file.read_text().splitlines() if ln.strip()]
        assert len(pids) == 3 and all(_running(p) for p in pids)

        # idempotent: a second up starts nothing new
        again = _run("cluster-up.sh", env, timeout=120)
        assert again.returncode == 0, again.stderr
        assert "already running" in again.stderr
        assert [int(ln.split()[1]) for ln in pids_file.read_text().splitlines()] == pids

        # servers listen on loopback only
        for port in (ctld_port, d_port):
            addrs = _listening_addrs(port)
            if addrs:  # /proc/net/tcp readable
                assert addrs <= {"0100007F", "0000000000000000FFFF00000100007F"}, (port, addrs)

        # a trivial batch job through the wrappers (they carry SLURM_CONF)
        bin_dir = state / "bin"
        jenv = dict(env, PATH=f"{bin_dir}:{env.get('PATH', '')}")
        out = tmp_path / "job.out"
        sub = subprocess.run(
            ["sbatch", "--parsable", "-p", "debug", "--mem", "100", "-o", str(out),
             "--wrap", "echo hello-from-slurm $SLURM_JOB_ID; srun -n1 echo step-ok"],
            env=jenv, capture_output=True, text=True, timeout=30, cwd=tmp_path,
        )  # fmt: skip
        assert sub.returncode == 0, sub.stderr
        jobid = sub.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 60
        info = ""
        while time.monotonic() < deadline:
            info = subprocess.run(
                ["scontrol", "show", "job", jobid], env=jenv, capture_output=True, text=True,
                timeout=15,
            ).stdout  # fmt: skip
            if "JobState=COMPLETED" in info or "JobState=FAILED" in info:
                break
            time.sleep(0.5)
        assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info
        text = out.read_text()
        assert f"hello-from-slurm {jobid}" in text and "step-ok" in text, text
    finally:
        if not pids and pids_file.is_file():
            pids = [int(ln.split()[1]) for ln in pids_file.read_text().splitlines() if ln.strip()]
        down = _run("cluster-down.sh", env, timeout=120)
    assert down.returncode == 0, down.stderr
    assert pids and not any(_running(p) for p in pids), pids
    # idempotent down
    assert _run("cluster-down.sh", env, timeout=60).returncode == 0


def test_daemon_that_dies_at_start_is_reported_and_nothing_is_left(tmp_path):
    """A daemon exiting at once fails cluster-up with its exit status and log; the rest is stopped.

    The failing slurmd is a shell stand-in first on PATH (the point is our start-up bookkeeping, not
    slurmd); munged and slurmctld are the real daemons.
    """
    state = tmp_path / "slurm"
    shims = tmp_path / "shims"
    shims.mkdir()
    fake = shims / "slurmd"
    fake.write_text('#!/bin/sh\necho "stand-in slurmd: refusing to start" >&2\nexit 3\n')
    fake.chmod(0o755)
    ctld_port, d_port = _free_port(), _free_port()
    env = dict(
        os.environ,
        PATH=f"{shims}:{os.environ.get('PATH', '')}:/usr/sbin:/sbin",
        KVCERT_SLURM_DIR=str(state),
        KVCERT_SLURM_CTLD_PORT=str(ctld_port),
        KVCERT_SLURM_D_PORT=str(d_port),
        KVCERT_SLURM_ETC="0",
    )
    env.pop("SLURM_CONF", None)
    up = _run("cluster-up.sh", env, timeout=240)
    if up.returncode != 0 and "apt-get install" in up.stderr:
        pytest.skip(f"could not install slurm/munge: {up.stderr.strip()[-300:]}")
    try:
        assert up.returncode != 0
        assert "slurmd" in up.stderr and "exited right after start (exit status 3)" in up.stderr
        assert "stand-in slurmd: refusing to start" in up.stderr, up.stderr  # its log tail is shown
        # cluster-up stopped the daemons it had started before failing
        for name in ("munged", "slurmctld"):
            assert f"stopped {name}" in up.stderr, up.stderr
    finally:
        _run("cluster-down.sh", env, timeout=120)
    leftovers = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _running(int(proc.name)):
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(state) in cmd:
                leftovers.append(cmd)
    assert not leftovers, leftovers

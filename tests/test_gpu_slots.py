"""kvcert-gpu-slot: one machine, several GPUs, every GPU cell on a device no other cell holds.

No GPU is needed: the devices are the entries of CUDA_VISIBLE_DEVICES (what SLURM or a user sets), and
what is tested is the assignment. Each holder in these tests marks its device with an O_EXCL file for
as long as it runs, so two holders of one device at once would fail loudly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcert import gpu_slots

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SLOT = [sys.executable, "-m", "kvcert.gpu_slots"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
       "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}

# A job: hold the device(s) in CUDA_VISIBLE_DEVICES exclusively for a moment, and record them.
HOLDER = textwrap.dedent("""
    import os, sys, time
    marks, log = sys.argv[1], sys.argv[2]
    devices = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    paths = [os.path.join(marks, f"busy-{d}") for d in devices]
    fds = [os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY) for p in paths]  # fails if another holder has it
    if len(sys.argv) > 4:  # no more holders at once than the scheduler allows
        assert len(os.listdir(marks)) <= int(sys.argv[4]), os.listdir(marks)
    time.sleep(float(sys.argv[3]))
    for fd, p in zip(fds, paths):
        os.close(fd); os.unlink(p)
    with open(log, "a") as f:
        f.write(",".join(devices) + "\\n")
""")


@pytest.fixture()
def holder(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    (tmp_path / "marks").mkdir()
    return script


def _env(devices: str, **extra) -> dict[str, str]:
    env = {**ENV, "CUDA_VISIBLE_DEVICES": devices, **extra}
    env.pop("SLURM_JOB_ID", None)
    return env


def test_devices_come_from_cuda_visible_devices():
    assert gpu_slots.visible_devices({"CUDA_VISIBLE_DEVICES": "2, 5,7"}) == ["2", "5", "7"]
    assert gpu_slots.visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gpu_slots.visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_acquire_gives_distinct_devices_and_release_frees_them(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    a = gpu_slots.acquire(2, lock_dir=tmp_path, environ=env)
    b = gpu_slots.acquire(1, lock_dir=tmp_path, environ=env)
    assert sorted(d for d, _ in a + b) == ["0", "1", "2"]
    with pytest.raises(gpu_slots.SlotError, match="became free within"):
        gpu_slots.acquire(1, lock_dir=tmp_path, environ=env, wait=0.3, poll=0.05)
    gpu_slots.release(a)
    again = gpu_slots.acquire(2, lock_dir=tmp_path, environ=env, wait=5)
    assert sorted(d for d, _ in again) == sorted(d for d, _ in a)
    gpu_slots.release(again + b)


def test_locks_are_per_slurm_job(tmp_path):
    """Jobs on one node may each see their own GPU as device 0: their locks must not collide."""
    first = gpu_slots.acquire(1, lock_dir=tmp_path, environ={"CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_ID": "11"})
    second = gpu_slots.acquire(1, lock_dir=tmp_path, environ={"CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_ID": "12"},
                               wait=2)
    assert [d for d, _ in first] == [d for d, _ in second] == ["0"]
    gpu_slots.release(first + second)


def test_concurrent_holders_never_share_a_device(tmp_path, holder):
    log = tmp_path / "log"
    procs = [subprocess.Popen([*SLOT, "--gpus", "1", "--lock-dir", str(tmp_path / "locks"), "--", sys.executable,
                               str(holder), str(tmp_path / "marks"), str(log), "0.4"],
                              env=_env("0,1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(6)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-500:] for r in results]
    used = log.read_text().split()
    assert len(used) == 6 and set(used) <= {"0", "1"}


def test_a_killed_holder_releases_its_device(tmp_path):
    locks = tmp_path / "locks"
    proc = subprocess.Popen([*SLOT, "--gpus", "1", "--lock-dir", str(locks), "--", "sleep", "600"],
                            env=_env("3"), stderr=subprocess.PIPE, text=True)
    try:
        assert "CUDA_VISIBLE_DEVICES=3" in proc.stderr.readline()  # it holds device 3 now
        with pytest.raises(gpu_slots.SlotError):
            gpu_slots.acquire(1, lock_dir=locks, environ={"CUDA_VISIBLE_DEVICES": "3"}, wait=0.3, poll=0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    held = gpu_slots.acquire(1, lock_dir=locks, environ={"CUDA_VISIBLE_DEVICES": "3"}, wait=30)
    assert [d for d, _ in held] == ["3"]
    gpu_slots.release(held)


def test_cli_errors_and_cpu_passthrough(tmp_path):
    none = subprocess.run([*SLOT, "--gpus", "1", "--lock-dir", str(tmp_path), "--", "true"], env=_env(""),
                          capture_output=True, text=True, timeout=60)
    assert none.returncode == 2
    assert none.stderr.strip().splitlines()[-1] == (
        "kvcert-gpu-slot: error: --gpus 1: only 0 GPU(s) visible (CUDA_VISIBLE_DEVICES: none)")
    no_command = subprocess.run([*SLOT, "--gpus", "1"], env=_env("0"), capture_output=True, text=True, timeout=60)
    assert no_command.returncode == 2 and "no command given" in no_command.stderr
    cpu = subprocess.run([*SLOT, "--gpus", "0", "--", sys.executable, "-c",
                          "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"],
                         env=_env("4,5"), capture_output=True, text=True, timeout=60)
    assert cpu.returncode == 0 and cpu.stdout.strip() == "4,5"  # untouched: nothing was assigned


SNAKEFILE = """
rule all:
    input: expand("done/{{i}}", i=range(8))

rule job:
    output: "done/{{i}}"
    resources: gpus=1
    shell: "{SLOT} --gpus {{resources.gpus}} --lock-dir locks -- {PYTHON} {HOLDER} marks used.log 0.5 2 && touch {{output}}"
"""


def test_snakemake_resources_gpus_runs_at_most_n_jobs_each_on_its_own_gpu(tmp_path, holder):
    """snakemake --cores 4 --resources gpus=2 on a machine with three GPUs: never two jobs on one GPU."""
    (tmp_path / "marks").mkdir(exist_ok=True)
    (tmp_path / "Snakefile").write_text(SNAKEFILE.format(
        SLOT=" ".join(SLOT), PYTHON=sys.executable, HOLDER=holder))
    proc = subprocess.run([str(BIN / "snakemake"), "--cores", "4", "--resources", "gpus=2", "--quiet"],
                          cwd=tmp_path, env=_env("0,1,2"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    used = (tmp_path / "used.log").read_text().split()
    assert len(used) == 8 and set(used) <= {"0", "1", "2"}

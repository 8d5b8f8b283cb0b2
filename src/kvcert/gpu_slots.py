"""``kvcert-gpu-slot``: run a command on GPUs of its own, on a machine whose GPUs several jobs share.

    kvcert-gpu-slot --gpus 1 -- kvcert-run model.device=cuda ...

Snakemake's ``--resources gpus=N`` bounds how many GPU cells run at once, but it does not say which
GPU each one should use: without help, every cell would land on ``cuda:0``. This tool picks free
GPUs for the command and starts it with ``CUDA_VISIBLE_DEVICES`` set to them, so that ``cuda`` inside
the command means its own devices.

A GPU is taken by holding an exclusive ``flock`` on its lock file (one per host and device). The lock
is held by the command itself (the tool ``exec``s it, keeping the lock's file descriptor open), so it
is released when the command ends in any way, killed with SIGKILL included; no stale lock survives a
dead holder. The candidates are the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (SLURM sets
it to a job's GPUs), else the GPUs ``nvidia-smi -L`` lists. Inside a SLURM job the lock files are
named by the job id too, since the jobs on a node may each see their own GPU as device 0.

With ``--gpus 0`` the command runs as it is (CPU cells go through the same rule).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class SlotError(RuntimeError):
    """No GPU can be assigned (none visible, or fewer than asked for); the message says which."""


def visible_devices(environ: dict[str, str] | None = None) -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES entries if set, else those nvidia-smi lists."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def default_lock_dir() -> Path:
    """Node-local: flock on a shared network filesystem is not reliable, and GPU ids are per node."""
    return Path(tempfile.gettempdir()) / f"kvcert-gpu-slots-{os.getuid()}"


def _lock_name(device: str, environ: dict[str, str]) -> str:
    job = environ.get("SLURM_JOB_ID")
    host = socket.gethostname().split(".")[0] or "host"
    return f"{host}{f'-job{job}' if job else ''}-gpu{device}.lock"


def try_acquire(devices: list[str], count: int, lock_dir: Path, environ: dict[str, str]) -> list[tuple[str, int]]:
    """Lock ``count`` free devices of ``devices`` (in order); returns (device, fd) pairs, or [] if too few are free."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    held: list[tuple[str, int]] = []
    for device in devices:
        fd = os.open(lock_dir / _lock_name(device, environ), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        held.append((device, fd))
        if len(held) == count:
            return held
    release(held)
    return []


def release(held: list[tuple[str, int]]) -> None:
    for _, fd in held:
        os.close(fd)  # closing the only descriptor drops the flock


def acquire(count: int, *, lock_dir: Path | None = None, wait: float | None = None, poll: float = 0.5,
            environ: dict[str, str] | None = None, notify=None) -> list[tuple[str, int]]:
    """Block until ``count`` devices are free and locked; returns (device, fd) pairs.

    wait: give up after this many seconds (None: wait as long as it takes; a scheduler that counts GPUs
    never starts more holders than there are devices, so waiting only bridges a holder that is exiting).
    """
    environ = dict(os.environ if environ is None else environ)
    devices = visible_devices(environ)
    if count > len(devices):
        source = "CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in environ else "nvidia-smi -L"
        raise SlotError(f"--gpus {count}: only {len(devices)} GPU(s) visible ({source}: "
                        f"{','.join(devices) if devices else 'none'})")
    lock_dir = Path(lock_dir) if lock_dir is not None else default_lock_dir()
    deadline = None if wait is None else time.monotonic() + wait
    told = False
    while True:
        held = try_acquire(devices, count, lock_dir, environ)
        if held:
            return held
        if deadline is not None and time.monotonic() >= deadline:
            raise SlotError(f"--gpus {count}: no {count} of the GPUs {','.join(devices)} became free "
                            f"within {wait:g} s (locks in {lock_dir})")
        if not told and notify is not None:
            notify(f"kvcert-gpu-slot: waiting for {count} free GPU(s) of {','.join(devices)}")
            told = True
        time.sleep(poll)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        at = argv.index("--")
        own, command = argv[:at], argv[at + 1 :]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(prog="kvcert-gpu-slot", description=__doc__.split("\n\n")[0],
                                     usage="kvcert-gpu-slot [--gpus N] [--lock-dir DIR] [--wait S] -- COMMAND ...")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the command needs (0: run it as it is)")
    parser.add_argument("--lock-dir", type=Path, default=None, help="node-local folder of the lock files")
    parser.add_argument("--wait", type=float, default=None, help="seconds to wait for free GPUs (default: no limit)")
    args = parser.parse_args(own)
    if not command:
        print("kvcert-gpu-slot: error: no command given (kvcert-gpu-slot --gpus N -- COMMAND ...)", file=sys.stderr)
        return 2
    if args.gpus < 0:
        print(f"kvcert-gpu-slot: error: --gpus={args.gpus}: must be >= 0", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.gpus > 0:
        try:
            held = acquire(args.gpus, lock_dir=args.lock_dir, wait=args.wait,
                           notify=lambda m: print(m, file=sys.stderr, flush=True))
        except (SlotError, OSError) as err:
            print(f"kvcert-gpu-slot: error: {err}", file=sys.stderr)
            return 2
        for _, fd in held:
            os.set_inheritable(fd, True)  # the command holds the locks until it exits
        env["CUDA_VISIBLE_DEVICES"] = ",".join(device for device, _ in held)
        print(f"kvcert-gpu-slot: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}", file=sys.stderr, flush=True)
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:
        print(f"kvcert-gpu-slot: error: cannot run {command[0]}: {err.strerror or err}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())

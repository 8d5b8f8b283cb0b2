"""One writer per shard: an exclusive lock on ``<out_dir>/.lock``, held for the whole of a cell's run.

Two runs of one shard (a job resubmitted while the first still runs, a second controller, a SLURM job
requeued while its old process lingers) would interleave checkpoints and tables. ``shard_lock(out_dir)``
takes a POSIX record lock (``fcntl``, which network filesystems forward to their lock service, unlike
``flock``) on the lock file without waiting; when another process holds it, it raises ``ShardBusy``, whose
one-line message names the shard and the holder (host, pid, SLURM job id if any, since when) as the holder
wrote them into the file.

The lock belongs to the process: it dies with it, so a lock file left by a killed run is simply taken over
(its old contents are overwritten). On a normal end the file is removed while still locked, and a taker
checks that the file it locked is still the one at the path (else it retries on the new file), so removal
cannot let two writers in. Within one process the same shard cannot be locked twice either (POSIX locks do
not conflict within a process; a set of held paths does).

A filesystem without locks (some Lustre mounts: ``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``) gets a warning on
stderr and no lock rather than no run. Costs one open, one lock and one small write per cell.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError

LOCK_NAME = ".lock"
_BUSY = (errno.EACCES, errno.EAGAIN)
_UNSUPPORTED = tuple(getattr(errno, name) for name in ("ENOLCK", "ENOSYS", "EOPNOTSUPP", "ENOTSUP") if hasattr(errno, name))
_HELD: set[str] = set()
_HELD_GUARD = threading.Lock()


class ShardBusy(ConfigError):
    """Another run holds the shard's lock; the message names the shard and the holder."""


def holder() -> dict:
    """Who this process is, as written into the lock file: host, pid, SLURM job id (None outside SLURM), start time."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ.get('SLURM_ARRAY_JOB_ID', job)}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": job or None,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def describe(found: dict | None) -> str:
    """The holder as the busy message names it, with how to stop it."""
    if not found:
        return "holder not yet recorded (it is starting)"
    job = found.get("slurm_job_id")
    where = f"host {found.get('host', '?')}, pid {found.get('pid', '?')}"
    where += f", SLURM job {job}" if job else ""
    where += f", since {found['since']}" if found.get("since") else ""
    stop = f"scancel {job}" if job else f"kill {found.get('pid', '?')} on {found.get('host', '?')}"
    return f"{where}; let it finish, or stop it ({stop}) and rerun"


def _read_holder(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
        found = json.loads(text) if text else None
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def created_dirs(path: Path) -> list[Path]:
    """The directories that ``path.mkdir(parents=True)`` would create, deepest first."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def remove_empty(dirs: list[Path]) -> None:
    """Remove ``dirs`` (deepest first, as ``created_dirs`` gives them), stopping at the first that holds something."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            break


@contextmanager
def shard_lock(out_dir: str | Path) -> Iterator[Path | None]:
    """Hold ``out_dir``'s writer lock for the body; yields the lock file (None where the filesystem has no locks).

    Creates ``out_dir`` if needed (and removes the directories it created if they are empty at the end, so a
    run refused later leaves nothing). Raises ShardBusy (a ConfigError) when another process or another
    caller in this process holds it, ConfigError when the directory or lock file cannot be created.
    """
    out_dir = Path(out_dir)
    path = out_dir / LOCK_NAME
    key = os.path.realpath(path)
    created = created_dirs(out_dir)
    with _HELD_GUARD:
        if key in _HELD:
            raise ShardBusy(f"out_dir={out_dir}: another run is writing this shard "
                            f"({describe(holder())}, in this process)")
        _HELD.add(key)
    fd = None
    try:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"out_dir={out_dir}: cannot write there ({err.strerror or err})") from None
        fd = _acquire(path, out_dir)
        try:
            yield path if fd is not None else None
        finally:
            if fd is not None:
                try:
                    path.unlink()  # still locked: a taker that opened the old file sees it is gone and retries
                except OSError:
                    pass
                os.close(fd)
                fd = None
    finally:
        if fd is not None:
            os.close(fd)
        with _HELD_GUARD:
            _HELD.discard(key)
        remove_empty(created)


def _acquire(path: Path, out_dir: Path) -> int | None:
    """Lock ``path`` (created if missing) and write this process's holder record; the locked descriptor."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"out_dir={out_dir}: cannot create its lock file {LOCK_NAME} "
                              f"({err.strerror or err})") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in _BUSY:
                found = _read_holder(fd)
                os.close(fd)
                raise ShardBusy(f"out_dir={out_dir}: another run is writing this shard ({describe(found)})") from None
            os.close(fd)
            if err.errno in _UNSUPPORTED:
                print(f"kvcert-run: warning: out_dir={out_dir}: this filesystem has no file locks "
                      f"({err.strerror}); a second run of this shard would not be stopped", file=sys.stderr)
                return None
            raise ConfigError(f"out_dir={out_dir}: cannot lock {LOCK_NAME} ({err.strerror or err})") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:  # the previous holder removed the file between our open and our lock: lock the new one
            os.close(fd)
            continue
        record = (json.dumps(holder(), sort_keys=True) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        return fd


__all__ = ["LOCK_NAME", "ShardBusy", "describe", "holder", "shard_lock"]

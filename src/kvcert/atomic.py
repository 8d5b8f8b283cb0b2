"""Writing files so that a reader never sees half of one: write to a temporary name beside the target,
then rename (``os.replace`` is atomic within a directory). A failed or killed write leaves at most a
hidden ``.<name>.<random>.tmp`` file, never a truncated target. Imports nothing from kvcert."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on normal exit it is renamed to ``path``, on error removed.

    The parent directory is created if needed. Use it for writers that want a file name
    (``DataFrame.to_parquet``, ``Figure.savefig``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def new_directory(target: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``target`` to fill; on success it becomes ``target`` in one rename, so
    readers see the whole directory or none of it.

    replace: remove an existing ``target`` first (else an existing one is an error, raised before anything
    is written). On any exception the temporary directory is removed and ``target`` is left as it was.
    """
    target = Path(target)
    if target.exists() and not replace:
        raise FileExistsError(f"{target} already exists; remove it to write it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(text: str, path: str | Path) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(payload, path: str | Path) -> None:
    """Write ``payload`` as strict JSON (NaN refused), indented, with a final newline, atomically."""
    write_text_atomic(json.dumps(payload, indent=2, allow_nan=False) + "\n", path)


def write_parquet_atomic(frame, path: str | Path) -> None:
    """Write a pandas DataFrame to parquet (no index) atomically."""
    with atomic_output(path) as tmp:
        frame.to_parquet(tmp, index=False)


def unwritable_reason(target: str | Path) -> str | None:
    """Why ``target`` (a directory to create or use) cannot be written, or None when it can.

    The nearest existing ancestor decides: it must be a writable directory.
    """
    target = Path(target)
    for path in (target, *target.parents):
        if path.exists():
            if not path.is_dir():
                return f"{path} is not a directory"
            if not os.access(path, os.W_OK | os.X_OK):
                return f"{path} is not writable"
            return None
    return None


__all__ = ["atomic_output", "unwritable_reason", "write_json_atomic", "write_parquet_atomic", "write_text_atomic"]

"""Writing a whole directory or nothing: what readers of a directory can rely on after a crash."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def new_directory(target: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``target`` to fill; on success it becomes ``target`` in one rename.

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

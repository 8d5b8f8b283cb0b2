"""Which code made a number: fingerprints of the code and of the checkout it was imported from.

- ``code_fingerprint()``: sha256 over the code that decides a cell's numbers: every file of the installed
  ``kvcert`` package except the analysis package (modules, the kernel source, configs, data assets), plus
  the versions of torch and transformers. A cell records it; a resumed cell refuses checkpoints of another;
  the workflow reruns a cell when it changes.
- ``analysis_fingerprint(root)``: sha256 over the analysis package, its config and the pre-registration
  files (the frozen thresholds and the code that applies them); the workflow reruns claims when it changes.
- ``source_checkout()``: the git commit of the repository that holds the imported package (not of the
  working directory), and whether that package's files differ from the commit; None with a reason when
  the package is not inside a git checkout.

Imports nothing heavy (no torch), so the workflow can compute fingerprints while it parses.
"""

from __future__ import annotations

import hashlib
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# Parts of the package that decide no cell's numbers: the analysis and its config (their own fingerprint).
_NOT_CELL_CODE = ("analysis", "conf/claim")
_SKIP_DIRS = ("__pycache__",)
_SKIP_SUFFIXES = (".pyc", ".pyo", ".so")
# Versions that change numbers without a change of our code.
_RUNTIME = ("torch", "transformers")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path, exclude: tuple[str, ...] = ()) -> list[Path]:
    """Files under ``root`` in a stable order, without caches and hidden files and outside the ``exclude``d
    sub-paths (relative, e.g. "conf/claim")."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if not path.is_file() or any(p in _SKIP_DIRS for p in rel):
            continue
        if any(rel[: len(e.split("/"))] == tuple(e.split("/")) for e in exclude):
            continue
        if path.suffix in _SKIP_SUFFIXES or path.name.startswith("."):
            continue
        out.append(path)
    return out


def _digest(entries: list[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for name, content in entries:
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def code_fingerprint(package: Path = PACKAGE) -> str:
    """sha256 (hex) of the cell code: the package's files except ``analysis/``, plus torch and transformers
    versions. Independent of where the package lives and of file times."""
    entries = [(p.relative_to(package).as_posix(), p.read_bytes()) for p in _files(package, _NOT_CELL_CODE)]
    entries += [(f"version:{name}", _version(name).encode()) for name in _RUNTIME]
    return _digest(entries)


def analysis_fingerprint(root: str | Path | None = None, package: Path = PACKAGE) -> str:
    """sha256 (hex) of the analysis package and of ``<root>/preregistration/`` (claims, amendments, locks)."""
    entries = [(p.relative_to(package).as_posix(), p.read_bytes())
                for part in _NOT_CELL_CODE for p in _files(package / part)]
    if root is not None and (Path(root) / "preregistration").is_dir():
        prereg = Path(root) / "preregistration"
        entries += [(f"preregistration/{p.relative_to(prereg).as_posix()}", p.read_bytes()) for p in _files(prereg)]
    return _digest(entries)


@lru_cache(maxsize=4)
def source_checkout(package: Path = PACKAGE) -> dict:
    """{"commit", "dirty", "reason"} of the git checkout holding ``package``.

    dirty: whether the package's own files (tracked or not) differ from the commit; results written into
    the same checkout do not count. commit and dirty are None, with the reason, outside a checkout.
    """
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None,
                    "reason": f"the imported package ({package.name}) is not inside a git checkout"}
        status = git("status", "--porcelain", "--untracked-files=normal", "--", ".")
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"commit": None, "dirty": None, "reason": f"git unavailable ({type(err).__name__})"}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()), "reason": None}


def numeric_platform() -> dict:
    """What decides float rounding besides the code: the machine, the CPU instruction set torch dispatches its
    kernels to, and the torch and transformers versions. Two runs on equal platforms give equal bytes."""
    import platform

    import torch

    return {"machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "transformers": _version("transformers")}


def short(fingerprint: str | None) -> str:
    """The first 12 hex digits (what messages show)."""
    return (fingerprint or "unknown")[:12]


__all__ = ["analysis_fingerprint", "code_fingerprint", "numeric_platform", "sha256_file", "short", "source_checkout"]

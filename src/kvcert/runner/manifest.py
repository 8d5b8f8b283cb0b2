"""The provenance written beside a cell's tables: versions, commit, model and data hashes, timings."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata

import torch

from ..models import ModelSpec, model_fingerprint

_PACKAGES = ("kvcert", "torch", "transformers", "numpy", "pandas", "pyarrow", "hydra-core", "gguf", "safetensors")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the working directory's repository, with '+dirty' if it has changes; None outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def build_manifest(spec: ModelSpec, dataset_sha256: str, timings: dict, n_items: int, n_rows: int) -> dict:
    return {
        "packages": {p: _version(p) for p in _PACKAGES},
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "device": spec.device,
        "git_commit": git_commit(),
        "model": model_fingerprint(spec),
        "dataset_sha256": dataset_sha256,
        "n_items": n_items,
        "n_item_rows": n_rows,
        "wall_seconds": {k: round(v, 3) for k, v in timings.items()},
    }

"""The provenance written beside a cell's tables: which code (fingerprint, commit), which path (compiled
kernel or PyTorch), which machine (device, dtype, versions), which inputs (model and dataset hashes) and
which outputs (sha256 of every table), plus wall time per stage."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

import torch

from ..models import ModelSpec, model_fingerprint
from ..provenance import code_fingerprint, numeric_platform, sha256_file, source_checkout

_PACKAGES = ("kvcert", "torch", "transformers", "numpy", "pandas", "pyarrow", "hydra-core", "gguf", "safetensors")
NO_CERTIFICATE = {"path": "none", "reason": "no certificate computed (certify=false and oracle=false)"}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def build_manifest(
    spec: ModelSpec,
    model,
    dataset_sha256: str,
    timings: dict,
    n_shard_items: int,
    n_rows: int,
    attention_path: dict | None,
    outputs: dict[str, Path],
    fingerprint: str | None = None,
) -> dict:
    """The manifest of one finished cell. outputs: table name -> path (hashed here)."""
    parameter = next(model.parameters())
    timings = dict(timings)
    return {
        "code_fingerprint": fingerprint or code_fingerprint(),
        "source": source_checkout(),
        "attention_path": attention_path or NO_CERTIFICATE,
        "device": str(parameter.device),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "requested_device": spec.device,
        "packages": {p: _version(p) for p in _PACKAGES},
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # everything the bytes depend on besides the code (CPU model and instruction sets, compiler, versions):
        # make verify-results demands equal bytes only where a rerun's platform equals this on every component
        "numeric_platform": numeric_platform(),
        "model": model_fingerprint(spec),
        "dataset_sha256": dataset_sha256,
        "n_shard_items": n_shard_items,
        "n_resumed_items": int(timings.pop("resumed_items", 0)),  # taken from checkpoints of an interrupted run
        "n_item_rows": n_rows,
        "outputs_sha256": {name: sha256_file(path) for name, path in sorted(outputs.items())},
        "wall_seconds": {k: round(v, 3) for k, v in timings.items()},
    }

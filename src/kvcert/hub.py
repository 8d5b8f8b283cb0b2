"""Fetching a Hugging Face model without loading it: what ``kvcert-fetch-model`` does for ``model=hf``.

The pipeline fetches models on the host that runs snakemake (a cluster's login node: network, often no
GPU and little memory) and the cells load them offline on compute nodes. So the fetch downloads the
repository's files into the Hugging Face cache (a token is needed for gated models: ``HF_TOKEN`` or
``hf auth login``), reads the config and the tensor shapes from the safetensors headers, and
never materializes the weights or touches a GPU.
"""

from __future__ import annotations

import math
from pathlib import Path

from .model_record import loading_files


def download(name: str) -> Path:
    """The local directory of ``name``: itself if it is a directory, else its snapshot in the HF cache.

    Only the files loading needs are fetched (``kvcert.model_record.loading_files``: not Llama's ``original/``,
    not Mistral's ``consolidated.safetensors``). With ``HF_HUB_OFFLINE=1`` the cached snapshot is returned as it is.
    """
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if HF_HUB_OFFLINE:
        return Path(snapshot_download(repo_id=name))
    keep = loading_files(s.rfilename for s in HfApi().model_info(name).siblings or [])
    # at the default revision (no commit pinned here), so that refs/main is written and later offline loads by
    # name find the snapshot
    return Path(snapshot_download(repo_id=name, allow_patterns=keep))


def safetensors_parameters(directory: Path) -> int:
    """Parameters stored in the directory's safetensors files, from their headers only."""
    from safetensors import safe_open

    total = 0
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                total += math.prod(handle.get_slice(key).get_shape())
    return total


class FetchError(OSError):
    """A model that cannot be fetched; the message names it and says why in one line."""


def fetch(name: str) -> dict[str, object]:
    """Download (if needed) and describe a model without loading it: {architecture, parameters, path}."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        directory = download(name)
        config = AutoConfig.from_pretrained(directory)
        AutoTokenizer.from_pretrained(directory)  # a broken or missing tokenizer fails here, not in every cell
    except (OSError, ValueError) as err:
        lines = str(err).strip().splitlines()
        hint = ""
        if type(err).__name__ == "GatedRepoError":
            hint = "; a gated model: accept its license on the hub, then set HF_TOKEN or run hf auth login here"
        raise FetchError(f"model.name={name}: cannot fetch ({type(err).__name__}: {lines[0] if lines else ''}){hint}") from None
    return {"architecture": (getattr(config, "architectures", None) or [type(config).__name__])[0],
            "parameters": safetensors_parameters(directory), "path": str(directory)}

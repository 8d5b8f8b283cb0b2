"""The model a calibration is bound to: a fingerprint of the loaded model's architecture and weights."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Config keys that do not change what a model computes (set by attach, or by where it was loaded from).
_VOLATILE_CONFIG_KEYS = ("_attn_implementation", "_attn_implementation_internal", "_name_or_path", "name_or_path",
                         "transformers_version", "_commit_hash")
_WEIGHT_SAMPLE = 64  # leading and trailing elements of every parameter that the weight hash reads


def model_identity(model) -> dict[str, Any]:
    """What a calibration is bound to: the loaded model's architecture and weights, in one place.

    config_sha256 hashes the model config (without keys that name where it came from or which attention
    runs); weights_sha256 hashes, for every parameter in order, its name, shape, dtype and its first and last
    64 values (a different checkpoint of the same architecture differs there; hashing everything would cost
    seconds per call). Also records the number of decoder layers and the model type, for messages.
    """
    import torch

    config = model.config.to_dict()
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    config_sha = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            sample = torch.cat([flat[:_WEIGHT_SAMPLE], flat[-_WEIGHT_SAMPLE:]]).to("cpu", torch.float32)
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    text = model.config.get_text_config(decoder=True)
    return {"model_type": str(getattr(text, "model_type", getattr(model.config, "model_type", "?"))),
            "num_layers": int(getattr(text, "num_hidden_layers", 0) or 0),
            "config_sha256": config_sha, "weights_sha256": digest.hexdigest()}

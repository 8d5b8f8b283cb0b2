"""Architectures of the paper's models, and how to find the configuration of any model a scale names.

``PUBLISHED`` holds the architecture fields of the paper scale's models (its study's three and the
leaderboard study's Qwen3-8B) as their
``config.json`` on the Hugging Face hub gives them, so that the cost model can size them (and the
stand-ins can copy their shape) on a machine that has neither the weights nor the network.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping

PUBLISHED: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-7B-Instruct": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": 131072, "max_window_layers": 28, "torch_dtype": "bfloat16",
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "bfloat16",
    },
    "mistralai/Mistral-7B-Instruct-v0.3": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
        "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # Qwen3 normalises each query and key head (RMSNorm of head_dim, "qk-norm") before RoPE; the model class
    # carries that, so no field says it. head_dim is explicit: 32 x 128 = 4096 = hidden_size.
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
        "torch_dtype": "bfloat16",
    },
}


class ArchitectureError(LookupError):
    """No configuration can be found for a model; the message names it and what was tried."""


def published(name: str) -> dict[str, Any]:
    return copy.deepcopy(PUBLISHED[name])


def model_config(spec: Mapping[str, Any]):
    """The ``transformers`` config of a model spec (``{kind, name, path, ...}`` as kvcert-run takes it).

    Tried in order, without network: a local directory's config.json, the Hugging Face cache, the
    published table above, and for GGUF/bundled models the converted copy kvcert caches.
    """
    from transformers import AutoConfig

    kind = spec.get("kind", "smollm2")
    if kind == "hf":
        name = str(spec.get("name"))
        if Path(name).is_dir():
            return AutoConfig.from_pretrained(name)
        try:
            return AutoConfig.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError):
            pass
        if name in PUBLISHED:
            fields = published(name)
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        raise ArchitectureError(f"model.name={name}: no config.json in the Hugging Face cache and not one of the "
                                f"published architectures ({', '.join(PUBLISHED)}); fetch it first "
                                "(kvcert-fetch-model) or point model.name at a local directory")
    from .models import ModelSpec, _converted_dir, fetch_smollm2

    parsed = ModelSpec.parse(dict(spec))
    gguf = fetch_smollm2() if parsed.kind == "smollm2" else Path(parsed.path)
    converted = _converted_dir(gguf)
    if (converted / "config.json").is_file():
        return AutoConfig.from_pretrained(converted)
    raise ArchitectureError(f"model.kind={kind}: no converted copy of {gguf.name} yet; run kvcert-fetch-model once")

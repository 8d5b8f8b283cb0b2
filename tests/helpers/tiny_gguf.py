"""Tiny random-weight GGUF files of architectures other than Llama, with a real tokenizer.

``write_tiny_gguf(path, arch)`` builds a small transformers model of ``arch`` from a config (hidden 64, a few
layers, seeded random weights), renames its tensors to GGUF's names with ``gguf.get_tensor_name_map``,
undoes what transformers' GGUF loader does to them (Gemma norms are stored as ``w + 1``), and writes F32
tensors plus the architecture's metadata keys. The tokenizer is a byte-level BPE built like SmolLM2's and trained on
the fly (``tests/helpers/tokenizer.py``), written as GGUF ``tokenizer.*`` keys, so that nothing is
downloaded; ``tokenizer_source=`` copies every ``tokenizer.*`` key of another GGUF file instead (e.g. the
bundled SmolLM2's). The vocabulary size is the tokenizer's.

Architectures (each loads with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` in
transformers 5.x):

* ``qwen2``      Qwen2: q/k/v biases, GQA 4 query heads / 2 KV heads;
* ``qwen2_mqa``  the same with one KV head (MQA);
* ``gemma3``     Gemma3 text: q/k norms, pre/post norms, 6 layers of which layers 0-4 use a sliding window
                 (transformers' default pattern: every 6th layer is global), head_dim from key_length;
* ``phi3``       Phi-3: fused qkv and gate_up projections, untied output;
* ``stablelm``   StableLM: LayerNorm with biases, partial rotary (25%), q/k/v biases.

The returned :class:`TinyGGUF` carries the source model, so a test can check that the GGUF loads back to
the same logits (a wrong tensor name would otherwise leave a randomly initialized weight in place).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN = 64
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
CONTEXT_LENGTH = 4096
SLIDING_WINDOW = 32
ARCHS = ("qwen2", "qwen2_mqa", "gemma3", "phi3", "stablelm")


@dataclass
class TinyGGUF:
    """A written file and what it was made from."""

    path: Path
    arch: str  # the name passed to write_tiny_gguf
    gguf_arch: str  # general.architecture in the file
    model: Any  # the transformers model whose weights the file holds (float32, eval mode)
    num_layers: int
    num_kv_heads: int
    sliding_layers: tuple[int, ...]


@functools.lru_cache(maxsize=4)
def tokenizer_fields(source: str | None = None) -> tuple[tuple[str, Any, Any, Any], ...]:
    """``(key, value, vtype, sub_type)`` of every ``tokenizer.*`` key of the GGUF file ``source`` (default: the
    tokenizer trained by ``tests/helpers/tokenizer.py``, no file read)."""
    if source is None:
        from helpers.tokenizer import gguf_fields

        return gguf_fields()
    try:
        return _tokenizer_fields_fast(source)
    except (ImportError, KeyError, TypeError):
        return _tokenizer_fields_reader(source)


def _tokenizer_fields_reader(source: str):
    """gguf's own reader: exact value types, but ~10 s for a 49k-token vocabulary (per-element parsing)."""
    import gguf

    out = []
    for key, field in gguf.GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), vtype, sub_type))
    return tuple(out)


def _tokenizer_fields_fast(source: str):
    """transformers' GGUF metadata reader (~0.5 s); value types as llama.cpp writes these keys."""
    from gguf import GGUFValueType as T
    from transformers.integrations.gguf import read_gguf_metadata

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    metadata, _ = read_gguf_metadata(source, arrays)
    out = []
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, bool):
            out.append((key, value, T.BOOL, None))
        elif isinstance(value, str):
            out.append((key, value, T.STRING, None))
        elif isinstance(value, int):
            out.append((key, value, T.UINT32, None))
        elif isinstance(value, list) and key in arrays:
            sub = {"tokenizer.ggml.token_type": T.INT32, "tokenizer.ggml.scores": T.FLOAT32}.get(key, T.STRING)
            out.append((key, list(value), T.ARRAY, sub))
        else:
            raise TypeError(f"{key}: unexpected metadata value {type(value).__name__}")
    if not any(key == "tokenizer.ggml.tokens" for key, *_ in out):
        raise KeyError("tokenizer.ggml.tokens")
    return tuple(out)


def vocab_size(source: str | None = None) -> int:
    for key, value, _, _ in tokenizer_fields(source):
        if key == "tokenizer.ggml.tokens":
            return len(value)
    raise ValueError("the tokenizer source has no tokenizer.ggml.tokens")


def _build(arch: str, vocab: int):
    """(transformers model, GGUF architecture name, metadata keys without the arch prefix)."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        StableLmConfig,
        StableLmForCausalLM,
    )

    common = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
                  vocab_size=vocab, max_position_embeddings=CONTEXT_LENGTH, bos_token_id=1, eos_token_id=2)
    meta = {"context_length": CONTEXT_LENGTH, "embedding_length": HIDDEN, "feed_forward_length": INTERMEDIATE,
            "attention.head_count": HEADS, "vocab_size": vocab}
    if arch in ("qwen2", "qwen2_mqa"):
        kv = 2 if arch == "qwen2" else 1
        config = Qwen2Config(**common, num_hidden_layers=2, num_key_value_heads=kv, tie_word_embeddings=True,
                             rope_theta=10000.0, rms_norm_eps=1e-6)
        meta.update({"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-6})
        return Qwen2ForCausalLM(config), "qwen2", meta | {"block_count": 2, "attention.head_count_kv": kv}
    if arch == "gemma3":
        config = Gemma3TextConfig(**common, num_hidden_layers=6, num_key_value_heads=2, head_dim=HEAD_DIM,
                                  sliding_window=SLIDING_WINDOW, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                  rope_theta=10000.0)
        meta.update({"block_count": 6, "attention.head_count_kv": 2, "attention.key_length": HEAD_DIM,
                     "attention.value_length": HEAD_DIM, "attention.sliding_window": SLIDING_WINDOW,
                     "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-6})
        return Gemma3ForCausalLM(config), "gemma3", meta
    if arch == "phi3":
        config = Phi3Config(**common, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False,
                            rope_theta=10000.0, rms_norm_eps=1e-5, pad_token_id=2)
        meta.update({"block_count": 2, "attention.head_count_kv": 2, "rope.freq_base": 10000.0,
                     "attention.layer_norm_rms_epsilon": 1e-5, "rope.dimension_count": HEAD_DIM})
        return Phi3ForCausalLM(config), "phi3", meta
    if arch == "stablelm":
        config = StableLmConfig(**common, num_hidden_layers=2, num_key_value_heads=2, use_qkv_bias=True,
                                use_parallel_residual=False, tie_word_embeddings=False, layer_norm_eps=1e-5,
                                partial_rotary_factor=0.25)
        meta.update({"block_count": 2, "attention.head_count_kv": 2, "attention.layer_norm_epsilon": 1e-5,
                     "rope.dimension_count": HEAD_DIM // 4})
        return StableLmForCausalLM(config), "stablelm", meta
    raise ValueError(f"arch={arch!r}: expected one of {ARCHS}")


def _gguf_tensors(model, gguf_arch: str, num_layers: int) -> dict[str, np.ndarray]:
    """The model's state dict under GGUF tensor names, pre-transformed so the loader gets it back."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch)
    names = gguf.get_tensor_name_map(arch_id, num_layers)
    out = {}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # no output.weight in the file: the loader ties the embeddings
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"{gguf_arch}: no GGUF name for {hf_name}")
        array = tensor.detach().float().numpy().copy()
        if gguf_arch == "gemma3" and name.endswith("norm") and suffix == "weight":
            array = array + 1.0  # Gemma2TensorProcessor subtracts 1 from every *norm.weight
        out[f"{name}.{suffix}"] = np.ascontiguousarray(array, dtype=np.float32)
    return out


def write_tiny_gguf(
    path: str | Path, arch: str = "qwen2", *, seed: int = 0, tokenizer_source: str | None = None
) -> TinyGGUF:
    """Write a tiny random-weight ``arch`` model with the built (or ``tokenizer_source``'s) tokenizer to ``path``."""
    import gguf
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = tokenizer_fields(tokenizer_source)
    torch.manual_seed(seed)
    model, gguf_arch, meta = _build(arch, vocab_size(tokenizer_source))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0 if gguf_arch == "gemma3" else 1.0, 0.1)  # Gemma norms are (1 + w)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.3 if param.ndim == 2 and "embed" not in name else 1.0)
    model.eval()
    num_layers = model.config.num_hidden_layers

    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_key_value("general.name", f"kvcert tiny {arch}", gguf.GGUFValueType.STRING)
    writer.add_key_value("general.file_type", 0, gguf.GGUFValueType.UINT32)  # all F32
    for key, value in meta.items():
        full = f"{gguf_arch}.{key}"
        if isinstance(value, float):
            writer.add_key_value(full, value, gguf.GGUFValueType.FLOAT32)
        else:
            writer.add_key_value(full, int(value), gguf.GGUFValueType.UINT32)
    for key, value, vtype, sub_type in fields:
        writer.add_key_value(key, value, vtype, sub_type)
    for name, array in _gguf_tensors(model, gguf_arch, num_layers).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    text = model.config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return TinyGGUF(path=path, arch=arch, gguf_arch=gguf_arch, model=model, num_layers=num_layers,
                    num_kv_heads=text.num_key_value_heads, sliding_layers=sliding)


_SHARED: dict[tuple[str, str], TinyGGUF] = {}


def shared_tiny_gguf(tmp_path_factory, arch: str) -> TinyGGUF:
    """One file per architecture for the whole pytest session (under its base temp directory)."""
    base = tmp_path_factory.getbasetemp() / "tiny-gguf"
    key = (str(base), arch)
    if key not in _SHARED:
        _SHARED[key] = write_tiny_gguf(base / f"tiny-{arch}.gguf", arch)
    return _SHARED[key]


def shared_kvcert_cache(tmp_path_factory) -> Path:
    """A KVCERT_CACHE for converting the tiny GGUFs, shared by the session (keyed by sha256 inside)."""
    path = tmp_path_factory.getbasetemp() / "kvcert-cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def converted_dir(cache: Path, gguf_path: Path) -> Path:
    """Where kvcert.models caches the de-quantized copy of ``gguf_path`` inside ``cache``."""
    from kvcert.models import sha256_file

    return Path(cache) / "converted" / sha256_file(gguf_path)[:16]

"""Tiny random-weight transformers models built from configs (no download), shared by the generation tests.

Every architecture has 4 query heads over 2 KV heads (GQA) unless its name says otherwise, hidden size 64 and
2 layers, and a 300-token vocabulary; those with a sliding window use ``WINDOW`` tokens, shorter than every
prompt of the tests. ``build(arch)`` returns a stock-``sdpa`` reference and an independent copy prepared for
kvcert, with the same weights.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
)


VOCAB = 300
WINDOW = 8  # sliding window, shorter than every prompt of the tests

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
)

# llama_mqa: one KV head; mistral, qwen2 (first layer only) and gemma3 (first layer only): sliding windows;
# phi3: fused qkv and gate_up projections; stablelm: LayerNorm, q/k/v biases and partial rotary (25%).
ARCHS = ["llama", "llama_mqa", "mistral", "qwen2", "gemma3", "phi3", "stablelm"]


def config(arch: str, window: int = WINDOW):
    """(config, model class, whether some layer uses a sliding window)."""
    if arch == "llama":
        return LlamaConfig(**COMMON), LlamaForCausalLM, False
    if arch == "llama_mqa":
        return LlamaConfig(**{**COMMON, "num_key_value_heads": 1}), LlamaForCausalLM, False
    if arch == "mistral":
        return MistralConfig(**COMMON, sliding_window=window), MistralForCausalLM, True
    if arch == "qwen2":
        cfg = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=window, max_window_layers=1)
        assert "sliding_attention" in cfg.layer_types
        return cfg, Qwen2ForCausalLM, True
    if arch == "gemma3":
        cfg = Gemma3TextConfig(
            **COMMON, head_dim=16, sliding_window=window, layer_types=["sliding_attention", "full_attention"]
        )
        return cfg, Gemma3ForCausalLM, True
    if arch == "phi3":
        return Phi3Config(**COMMON, pad_token_id=0), Phi3ForCausalLM, False
    if arch == "stablelm":
        cfg = StableLmConfig(**COMMON, use_qkv_bias=True, partial_rotary_factor=0.25)
        return cfg, StableLmForCausalLM, False
    raise ValueError(arch)


def build(arch: str, seed: int = 0, window: int = WINDOW):
    """A stock-``sdpa`` reference model, an independent kvcert copy with the same weights, and whether some
    layer has a sliding window."""
    cfg, cls, sliding = config(arch, window)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    reference = cls(cfg).eval()
    model = copy.deepcopy(reference)  # kvcert calls attach their own attention to it, scoped
    assert reference.config._attn_implementation == "sdpa"
    return reference, model, sliding


def prompt(seed: int, n_context: int = 40, n_question: int = 6):
    """Random (1, n_context) context ids and (1, n_question) question ids, seeded."""
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(3, VOCAB, (1, n_context), generator=g)
    question = torch.randint(3, VOCAB, (1, n_question), generator=g)
    return context, question

"""What a cell costs: memory at its peak, FLOPs and bytes per forward pass, and time on a device.

Pure functions of a decoder's architecture (read from a ``transformers`` config), the prompt length,
the batch rows a cell decodes together and the dtype. They follow what ``kvcert-run`` holds:

* the weights;
* the prefill's cache: keys and values in the model's dtype plus, per slot, log π and the offset
  (float32) and the original position (int64), for every layer and KV head;
* the decode batches: one per budget (the full cache alone first), each row a configuration whose
  cache is physically compressed to ``budget × n`` slots (rows padded to the longest) with room for
  the tokens it will append;
* the certificate: each certified call is reduced to a few float32 numbers per row, KV head and query
  position (trace, output norm, term sums; true error and Wald coverage with the oracle) that the recorder
  keeps for every layer until the pass ends; everything per slot lives inside the one attention call that
  computes it (on the PyTorch path a float32 cast of one layer's keys and values where the model's dtype is
  narrower, the weights of the call's query rows and the centred sampled values: counted with that call's
  transients, never summed over layers);
* the oracle: the prefill's cache is kept (it is already counted) and every pass attends to it too;
  a multi-token pass (the question, in the streaming setting) materializes float32 logits, mask and
  weights of shape (rows, query heads, tokens, n), one layer at a time;
* transients of the prefill: MLP activations, q/k/v, and H2O's accumulated attention (float32 logits
  of 256 queries at a time over all keys, the keys repeated to the query heads).

Time is a roofline per pass, max(FLOPs / achieved FLOP/s, bytes / achieved bytes/s), plus a host-side
overhead per layer and pass (Python and kernel dispatch, measured on a CPU by
``benchmarks/plan_check.py``), summed over the prefill and every decode pass of every batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


# Model types whose attention normalises each query and key head (one weight of head_dim each, shared by heads).
QK_NORM_MODEL_TYPES = frozenset({"qwen3"})


@dataclass(frozen=True)
class Architecture:
    """The sizes of a decoder-only transformer that memory and FLOPs depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm weight of head_dim on each query and key head (Qwen3)

    @classmethod
    def from_config(cls, config) -> Architecture:
        """From a ``transformers`` config (its text config for multimodal ones)."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            layers=int(text.num_hidden_layers), hidden=int(text.hidden_size), heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
            intermediate=int(text.intermediate_size), vocab=int(text.vocab_size),
            tied=bool(getattr(text, "tie_word_embeddings", False)),
            qkv_bias=getattr(text, "model_type", "") == "qwen2" or bool(getattr(text, "attention_bias", False)),
            qk_norm=getattr(text, "model_type", "") in QK_NORM_MODEL_TYPES,
        )

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: attention projections (and Qwen3's q/k norms), gated MLP, two norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        attention += 2 * self.head_dim if self.qk_norm else 0
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_parameters + embeddings + self.hidden

    @property
    def matmul_parameters(self) -> int:
        """Parameters multiplied per token (the layers and the output layer; the embedding is a lookup)."""
        return self.layers * self.layer_parameters + self.vocab * self.hidden


def weight_bytes(arch: Architecture, dtype: str) -> int:
    return arch.parameters * DTYPE_BYTES[dtype]


def slot_bytes(arch: Architecture, dtype: str) -> int:
    """One cached token in every layer and KV head: key, value, log π and offset (float32), position (int64)."""
    return arch.layers * arch.kv_heads * (2 * arch.head_dim * DTYPE_BYTES[dtype] + 4 + 4 + 8)


def full_cache_bytes(arch: Architecture, n: int, dtype: str) -> int:
    return n * slot_bytes(arch, dtype)


@dataclass(frozen=True)
class Batch:
    """Configurations decoded together: ``rows`` rows at retained fraction ``budget`` (1.0: the full cache)."""

    rows: int
    budget: float
    randomized_rows: int = 0  # rows with a Poisson tail (they carry certificates)


@dataclass(frozen=True)
class Prompt:
    """One item as a cell runs it: n prefilled tokens, suffix tokens fed after compression (the question
    in the streaming setting, else 0), up to new_tokens generated."""

    n: int
    suffix: int
    new_tokens: int


@dataclass(frozen=True)
class CellPlan:
    """What a cell runs per item (every item of a workload shares these settings)."""

    batches: tuple[Batch, ...]
    oracle: bool = True
    certify: bool = True
    accumulate: bool = False  # some policy needs accumulated attention (h2o)
    head_fraction: float = 0.5
    n_sink: int = 4
    n_recent: int = 32
    window: int = 16
    kernel_path: bool = False  # a fused kernel (compiled CPU or Triton) computes the variance: no float32 copies


def retained_slots(n: int, budget: float) -> int:
    return n if budget >= 1.0 else max(1, math.ceil(budget * n))


def sampled_slots(n: int, budget: float, plan: CellPlan) -> int:
    """Slots with π < 1: the budget beyond the certain head (sinks, recent window, top slice)."""
    if budget >= 1.0:
        return 0
    kept = retained_slots(n, budget)
    head = min(kept, plan.n_sink + plan.n_recent + int(plan.head_fraction * kept))
    return max(0, kept - head)


def prefill_transient_bytes(arch: Architecture, n: int, dtype: str, plan: CellPlan) -> int:
    """Largest short-lived tensors of the prefill of n tokens (one layer at a time)."""
    b = DTYPE_BYTES[dtype]
    mlp = 3 * n * arch.intermediate * b  # gate, up and their product
    hidden = 4 * n * arch.hidden * b  # residual stream, normed input, attention output, projection
    qkv = n * (arch.heads + 2 * arch.kv_heads) * arch.head_dim * b + 2 * n * arch.head_dim * 4  # + rope cos/sin
    h2o = 0
    if plan.accumulate:  # float32 logits and softmax of 256 queries over n keys; keys repeated to the query heads
        h2o = 3 * arch.heads * min(256, n) * n * 4 + arch.heads * n * arch.head_dim * 4
    accumulated = arch.layers * arch.heads * n * 4 if plan.accumulate else 0
    window = arch.layers * arch.heads * plan.window * arch.head_dim * b
    return max(mlp + hidden, qkv + hidden + h2o) + accumulated + window + arch.vocab * 4


def batch_bytes(arch: Architecture, prompt: Prompt, batch: Batch, dtype: str, plan: CellPlan) -> dict[str, int]:
    """Memory a decode batch adds to the weights and the prefill's cache at its peak, by component.

    The peak is during its first pass (m = the suffix tokens, or 1): the certificate summaries of the layers
    done so far are held while one layer's attention (and the oracle's, over the full prefix) has its float32
    logits, mask and weights alive, and, on the PyTorch path, the call's float32 keys and values and its
    centred sampled values.
    """
    reserve = prompt.suffix + prompt.new_tokens
    slots = retained_slots(prompt.n, batch.budget) + reserve
    cache = batch.rows * slots * slot_bytes(arch, dtype)
    m = max(prompt.suffix, 1)
    compressed = batch.budget < 1.0
    certificate = 0
    attention = 3 * batch.rows * arch.heads * m * slots * 4
    if plan.certify and compressed:
        per_position = 5 if plan.oracle else 3  # trace, norm and 2 term sums (+ true error, Wald coverage) …
        certificate = arch.layers * batch.rows * arch.kv_heads * m * (per_position + 1) * 4  # … stacked at the end
        if not plan.kernel_path:  # inside one call: keys and values cast to float32, centred sampled values
            t = sampled_slots(prompt.n, batch.budget, plan)
            cast = 2 * slots if DTYPE_BYTES[dtype] < 4 else 0
            attention += batch.rows * arch.kv_heads * (cast + t) * arch.head_dim * 4
    oracle = 3 * batch.rows * arch.heads * m * (prompt.n + reserve) * 4 if plan.oracle and compressed else 0
    activations = batch.rows * m * (3 * arch.intermediate + 4 * arch.hidden) * DTYPE_BYTES[dtype]
    logits = batch.rows * arch.vocab * 4 * 2
    parts = {"certificate_moments": certificate,
             "oracle_transients": oracle if oracle >= max(attention, activations) else 0,
             "decode_transients": max(attention, activations) if max(attention, activations) > oracle else 0}
    parts["decode_transients"] += logits
    return {"batch_cache": cache, **parts}


def peak_bytes(arch: Architecture, prompt: Prompt, dtype: str, plan: CellPlan) -> dict[str, int]:
    """Peak memory of one item, by component (the largest batch decides; ``total`` is their sum)."""
    full = full_cache_bytes(arch, prompt.n, dtype)
    prefill = prefill_transient_bytes(arch, prompt.n, dtype, plan)
    batches = [batch_bytes(arch, prompt, b, dtype, plan) for b in plan.batches]
    worst = max(batches, key=lambda parts: sum(parts.values())) if batches else {}
    decode_peak = sum(worst.values()) if worst else 0
    out = {"weights": weight_bytes(arch, dtype), "full_cache": full}
    if prefill >= decode_peak:
        out.update({"prefill_transients": prefill, "batch_cache": 0, "certificate_moments": 0,
                    "oracle_transients": 0, "decode_transients": 0})
    else:
        out.update({"prefill_transients": 0, **worst})
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------- FLOPs and bytes


def prefill_flops(arch: Architecture, n: int, plan: CellPlan) -> float:
    """Matmul FLOPs of a prefill of n tokens (causal attention; H2O's extra pass over all keys)."""
    dense = 2.0 * arch.layers * arch.layer_parameters * n + 2.0 * arch.hidden * arch.vocab
    attention = 2.0 * arch.layers * arch.heads * arch.head_dim * n * n  # QKᵀ and AV, causal halves
    accumulate = 2.0 * arch.layers * arch.heads * arch.head_dim * n * n if plan.accumulate else 0.0
    return dense + attention + accumulate


def decode_pass_cost(arch: Architecture, prompt: Prompt, batch: Batch, m: int, step: int, dtype: str,
                     plan: CellPlan) -> tuple[float, float]:
    """(FLOPs, bytes) of one forward pass of m tokens per row at decode step ``step`` of a batch."""
    b = DTYPE_BYTES[dtype]
    slots = retained_slots(prompt.n, batch.budget) + step + m
    kv = 2 * arch.layers * arch.kv_heads * arch.head_dim
    flops = batch.rows * m * 2.0 * arch.matmul_parameters
    flops += batch.rows * m * 2.0 * 2 * arch.layers * arch.heads * arch.head_dim * slots
    moved = weight_bytes(arch, dtype) + batch.rows * slots * kv * b
    if plan.oracle and batch.budget < 1.0:  # the same queries over the full prefix, read once for all rows
        flops += batch.rows * m * 2.0 * 2 * arch.layers * arch.heads * arch.head_dim * (prompt.n + step + m)
        moved += (prompt.n + step + m) * kv * b
    if plan.certify and batch.budget < 1.0 and not plan.kernel_path:
        # the variance's two matmuls over the sampled slots (Σc(v − μ), Σc(v − μ)²) and the centring, per call
        t = sampled_slots(prompt.n, batch.budget, plan)
        width = 2 * arch.head_dim if plan.oracle else arch.head_dim + 1
        flops += batch.rows * m * 2.0 * arch.layers * arch.heads * t * width
        moved += arch.layers * batch.rows * arch.kv_heads * t * arch.head_dim * 4 * 2
    return flops, moved


@dataclass(frozen=True)
class Device:
    """A device's nominal rates and what fraction of them eager PyTorch is assumed to reach."""

    name: str
    memory_gb: float
    flops: float  # dense bf16 FLOP/s (float32 for a CPU)
    bandwidth: float  # bytes/s
    compute_efficiency: float
    memory_efficiency: float
    overhead_per_layer_pass: float  # seconds of host work per layer and forward pass


def item_seconds(arch: Architecture, prompt: Prompt, dtype: str, plan: CellPlan, device: Device) -> dict[str, float]:
    """Seconds of one item on ``device``: the prefill, then every pass of every batch."""
    flops_rate = device.flops * device.compute_efficiency
    bytes_rate = device.bandwidth * device.memory_efficiency
    pass_overhead = device.overhead_per_layer_pass * arch.layers
    prefill = prefill_flops(arch, prompt.n, plan) / flops_rate + pass_overhead
    decode, passes = 0.0, 0
    for batch in plan.batches:
        steps = [(prompt.suffix, 0)] if prompt.suffix else []
        steps += [(1, prompt.suffix + k) for k in range(max(prompt.new_tokens - 1, 0))]
        for m, step in steps:
            flops, moved = decode_pass_cost(arch, prompt, batch, m, step, dtype, plan)
            decode += max(flops / flops_rate, moved / bytes_rate) + pass_overhead
            passes += 1
    return {"prefill": prefill, "decode": decode, "passes": passes, "total": prefill + decode}

"""What a scoring policy sees, and the registry of policies by name.

A policy turns what the prefill observed in one layer into an importance score per cached token and KV
head, (batch, kv_heads, n); larger is more important. Scores of the query heads that share a KV head
(GQA) are averaged, so each KV head gets one retained set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..query_statistics import QueryStatistics


@dataclass(frozen=True)
class LayerView:
    """One layer's prefill state, as the policies read it.

    keys, values: (batch, kv_heads, n, head_dim) post-RoPE keys and values of the prefix;
    window_queries: (batch, q_heads, w, head_dim) post-RoPE queries of the last w prefix positions;
    accumulated_attention: (batch, q_heads, n) column sums of the prefill attention, or None when not
    collected; scale: the attention scale of the layer; sliding_window: the layer's window or None;
    query_statistics: the prefix queries' mean and covariance before RoPE and the layer's rotary tables after
    the prefix (``kvcert.query_statistics.QueryStatistics``; ExpectedAttention), or None when not collected;
    output_projection: (hidden, q_heads·head_dim) the layer's output projection weight W_o (CriticalKV), or
    None where the model has none by that name; pre_rope_keys: (batch, kv_heads, n, head_dim) float32, the keys
    before RoPE (the post-RoPE keys un-rotated with the model's rotary tables; LeverageScore), or None when not
    collected.
    """

    keys: torch.Tensor
    values: torch.Tensor
    window_queries: torch.Tensor
    accumulated_attention: torch.Tensor | None
    scale: float
    sliding_window: int | None = None
    query_statistics: QueryStatistics | None = None
    output_projection: torch.Tensor | None = None
    pre_rope_keys: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return self.keys.shape[-2]

    @property
    def group_size(self) -> int:
        return self.window_queries.shape[1] // self.keys.shape[1]

    def group_mean(self, per_query_head: torch.Tensor) -> torch.Tensor:
        """(batch, q_heads, n) -> (batch, kv_heads, n), averaging the query heads of each KV head."""
        b, hq, n = per_query_head.shape
        return per_query_head.reshape(b, hq // self.group_size, self.group_size, n).mean(2)

    def window_attention(self) -> torch.Tensor:
        """Causal softmax attention of the window queries over all keys: (batch, q_heads, w, n), float32."""
        b, hq, w, d = self.window_queries.shape
        keys = self.keys.float().repeat_interleave(self.group_size, dim=1)
        logits = torch.matmul(self.window_queries.float(), keys.transpose(-1, -2)) * self.scale
        q_pos = torch.arange(self.n - w, self.n, device=keys.device).unsqueeze(-1)
        k_pos = torch.arange(self.n, device=keys.device)
        allowed = k_pos <= q_pos
        if self.sliding_window is not None:
            allowed &= k_pos > q_pos - self.sliding_window
        logits = logits.masked_fill(~allowed, float("-inf"))
        return torch.softmax(logits, dim=-1)


class Policy(Protocol):
    """A scoring policy: ``score(view) -> (batch, kv_heads, n)`` non-negative importance.

    A policy that draws (a sketch) draws from ``generator``; without one, from a generator seeded 0
    (``kvcert.seeding.generator_or_seeded_zero``), never from torch's global generator: a policy's scores are a
    function of its view and its generator.

    needs_accumulated_attention / needs_query_statistics / needs_pre_rope_keys: what the prefill must collect
    for it (each costs the prefill a pass or a copy; collected only when a policy of the run asks)."""

    name: str
    needs_accumulated_attention: bool
    needs_query_statistics: bool
    needs_pre_rope_keys: bool
    certain_top_slice: bool  # False: the randomized design samples every non-sink, non-recent token

    def score(self, view: LayerView, generator: torch.Generator | None = None) -> torch.Tensor: ...


POLICIES: dict[str, Callable[..., Policy]] = {}


def register_policy(name: str):
    """Class decorator adding a policy to the registry under ``name``: a class whose instances (built with the
    policy's options as keywords) have ``score(view, generator=None) -> (batch, kv_heads, n)``; what it does not
    declare defaults to False (the ``needs_*`` flags: nothing more to collect at the prefill) and True
    (``certain_top_slice``: the Poisson design keeps a top slice certain)."""

    def wrap(cls):
        cls.name = name
        if not hasattr(cls, "certain_top_slice"):
            cls.certain_top_slice = True
        for need in ("needs_accumulated_attention", "needs_query_statistics", "needs_pre_rope_keys"):
            if not hasattr(cls, need):
                setattr(cls, need, False)
        POLICIES[name] = cls
        return cls

    return wrap


def prefill_needs(names, policy_options: dict | None = None) -> dict[str, bool]:
    """What a prefill must collect for the policies ``names`` built with their ``policy_options`` ({name:
    {option: value}}): the keywords ``accumulate``, ``query_statistics`` and ``pre_rope_keys`` of
    ``kvcert.prefill``."""
    options = policy_options or {}
    policies = [get_policy(name, **options.get(name, {})) for name in names]
    return {"accumulate": any(p.needs_accumulated_attention for p in policies),
            "query_statistics": any(p.needs_query_statistics for p in policies),
            "pre_rope_keys": any(p.needs_pre_rope_keys for p in policies)}


# Old names: a config that still uses one gets a line saying what it is called now.
RENAMED = {"streaming": "streamingllm"}


def get_policy(name: str, **options) -> Policy:
    """Instantiate a registered policy by name; unknown names raise a one-line ValueError."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r} is unknown; known: {sorted(POLICIES)}{renamed_hint(name)}")
    return POLICIES[name](**options)


def renamed_hint(name: str) -> str:
    """' (renamed ...)' for an old policy name, else ''."""
    if name in RENAMED:
        return f" ('{name}' is a setting; the StreamingLLM policy is '{RENAMED[name]}')"
    return ""

"""Scoring policies, one per module, registered by name."""

from . import (  # noqa: F401  (registration)
    cap, criticalkv, cur, expected_attention, h2o, keydiff, knorm, lagkv, leverage, observed_attention, snapkv,
    streamingllm, tova, uniform,
)
from .base import POLICIES, LayerView, Policy, get_policy, prefill_needs, register_policy

__all__ = ["POLICIES", "LayerView", "Policy", "get_policy", "prefill_needs", "register_policy"]

"""Scoring policies, one per module, registered by name."""

from . import cur, h2o, keydiff, knorm, lagkv, snapkv, streamingllm, tova, uniform  # noqa: F401  (registration)
from .base import POLICIES, LayerView, Policy, get_policy, register_policy

__all__ = ["POLICIES", "LayerView", "Policy", "get_policy", "register_policy"]

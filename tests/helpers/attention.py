"""Interposing on kvcert attention in tests: every decode attaches the attention function registered as
"kvcert", so a test that wants to see (or steer) each call registers a wrapper under that name for the
duration of a block and restores the real one afterwards."""

from __future__ import annotations

from contextlib import contextmanager

from transformers import AttentionInterface

from kvcert.attention import ATTENTION_NAME, kvcert_attention


@contextmanager
def interposed(wrapper):
    """Run the block with ``wrapper(module, query, key, value, attention_mask, **kwargs)`` as kvcert attention;
    the wrapper usually records something and then calls ``kvcert_attention``."""
    AttentionInterface.register(ATTENTION_NAME, wrapper)
    try:
        yield
    finally:
        AttentionInterface.register(ATTENTION_NAME, kvcert_attention)


def call_context(kwargs: dict):
    """The ``AttentionContext`` a kvcert attention call was given (None for a call without one)."""
    from kvcert.attention import CONTEXT_KWARG
    from kvcert.cache import CompressedCache
    from kvcert.context import AttentionContext

    ctx = kwargs.get(CONTEXT_KWARG) or kwargs.get("bound_context")
    return AttentionContext(ctx) if isinstance(ctx, CompressedCache) else ctx

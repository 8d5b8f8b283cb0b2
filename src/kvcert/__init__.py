"""kvcert: randomized KV-cache eviction with the Hájek logit offset and per-step error certificates.

Public API (stable): ``hajek_attention``, ``inclusion_probabilities``, ``poisson_sample``, ``certificate``,
``generate``, ``prefill`` / ``select`` / ``decode`` (one shared prefill, many configurations),
``CompressedCache``, ``prepare_model``, ``load_model``, and the registries ``POLICIES`` and ``DESIGNS``.

Names are imported on first use, so that command-line tools that need no model (the claim analyses)
do not pay for importing torch and transformers.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "prepare_model": "attention",
    "CompressedCache": "cache",
    "DESIGNS": "designs",
    "DesignOptions": "designs",
    "Selection": "designs",
    "EmptyRetainedSetError": "estimator",
    "certificate": "estimator",
    "hajek_attention": "estimator",
    "Decoding": "generation",
    "GenerationResult": "generation",
    "decode": "generation",
    "generate": "generation",
    "prefill": "generation",
    "select": "generation",
    "load_model": "models",
    "load_tokenizer": "models",
    "POLICIES": "policies",
    "LayerView": "policies",
    "budget_tokens": "sampling",
    "inclusion_probabilities": "sampling",
    "poisson_sample": "sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvcert' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

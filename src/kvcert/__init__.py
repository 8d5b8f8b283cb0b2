"""kvcert: randomized KV-cache eviction with the Hájek logit offset and per-step error certificates.

Public API (stable): ``hajek_attention``, ``inclusion_probabilities``, ``poisson_sample``, ``certificate``,
``generate``, ``prefill`` / ``select`` / ``decode`` (one shared prefill, many configurations),
``attach`` (the scoped switch to kvcert attention), ``press`` (kvcert around stock ``model.generate``, with a
certificate per answer), ``CompressedCache`` (storage) and its ``CertificateRecorder`` (statistics),
``load_model``, the registries ``POLICIES``, ``DESIGNS`` and ``ALLOCATORS``, and ``register_policy`` (a policy of
your own).
The formulas are in docs/METHOD.md, the vocabulary in docs/GLOSSARY.md.

Names are imported on first use, so that command-line tools that need no model (the claim analyses)
do not pay for importing torch and transformers.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "attach": "attention",
    "CompressedCache": "cache",
    "CertificateRecorder": "certificates",
    "StepRecord": "certificates",
    "ALLOCATORS": "allocators",
    "DESIGNS": "designs",
    "DesignOptions": "run_schema",
    "Selection": "designs",
    "EmptyRetainedSetError": "errors",
    "certificate": "estimator",
    "hajek_attention": "estimator",
    "Decoding": "generation",
    "GenerationResult": "generation",
    "decode": "generation",
    "generate": "generation",
    "item_seed": "generation",
    "prefill": "generation",
    "select": "generation",
    "load_model": "models",
    "load_tokenizer": "models",
    "POLICIES": "policies",
    "register_policy": "policies",
    "AnswerCertificate": "presses",
    "Press": "presses",
    "press": "presses",
    "build_prompt": "prompts",
    "LayerView": "policies",
    "retained_count": "sampling",
    "inclusion_probabilities": "sampling",
    "poisson_sample": "sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    # a submodule the docs name after ``import kvcert`` alone (kvcert.presses.register_pipeline(),
    # kvcert.targets.TargetNotMetWarning), imported on first use like the names above
    if not name.startswith("_"):
        from importlib.util import find_spec

        if find_spec(f"{__name__}.{name}") is not None:
            return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'kvcert' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

"""kvcert: randomized KV-cache eviction with the Hájek logit offset and per-step error certificates.

Public API (stable): ``hajek_attention``, ``inclusion_probabilities``, ``poisson_sample``, ``certificate``,
``generate``, ``prefill`` / ``select`` / ``decode`` (one shared prefill, many configurations),
``CompressedCache``, ``prepare_model``, ``load_model``, and the registries ``POLICIES`` and ``DESIGNS``.
"""

from .attention import prepare_model
from .cache import CompressedCache
from .designs import DESIGNS, DesignOptions, Selection
from .estimator import EmptyRetainedSetError, certificate, hajek_attention
from .generation import GenerationResult, decode, generate, prefill, select
from .models import load_model, load_tokenizer
from .policies import POLICIES, LayerView
from .sampling import budget_tokens, inclusion_probabilities, poisson_sample

__version__ = "0.1.0"

__all__ = [
    "DESIGNS",
    "POLICIES",
    "CompressedCache",
    "DesignOptions",
    "EmptyRetainedSetError",
    "GenerationResult",
    "LayerView",
    "Selection",
    "budget_tokens",
    "certificate",
    "decode",
    "generate",
    "hajek_attention",
    "inclusion_probabilities",
    "load_model",
    "load_tokenizer",
    "poisson_sample",
    "prefill",
    "prepare_model",
    "select",
]

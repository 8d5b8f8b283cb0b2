"""How a (context, question, answer prefix) becomes token ids, the same way for ``kvcert.generate`` and the
cell runner, so that the library and the pipeline give the same answer for the same item.

The context is encoded with the tokenizer's special tokens, ``question + answer_prefix`` without them,
and the two are concatenated, so that both settings see identical token ids: ``question_aware`` prefills
all of it; ``streaming`` prefills the context and feeds the rest after compression (docs/METHOD.md §5).
A prompt that does not fit the model's window (with room for the answer) has the middle of its context
cut (``truncate="middle"``) or is refused (``truncate="error"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError

SETTINGS = ("question_aware", "streaming")
TRUNCATE = ("middle", "error")
# Context tokens a truncated prompt must keep at least.
MIN_CONTEXT_TOKENS = 16


def check_setting(setting: str) -> str:
    if setting not in SETTINGS:
        raise ValueError(f"setting={setting!r} is unknown; known: {list(SETTINGS)}")
    return setting


@dataclass(frozen=True)
class PromptIds:
    """prefix_ids: (1, n) tokens prefilled before compression; suffix_ids: (1, s) tokens fed after it
    (the question and answer prefix in the streaming setting, empty otherwise); truncated: whether the
    context was cut to fit."""

    prefix_ids: torch.Tensor
    suffix_ids: torch.Tensor
    truncated: bool = False


def build_prompt(
    tokenizer,
    context: str,
    question: str,
    answer_prefix: str = "",
    *,
    setting: str = "question_aware",
    max_new_tokens: int = 16,
    limit: int | None = None,
    truncate: str = "middle",
    name: str = "prompt",
) -> PromptIds:
    """Token ids of a prompt after fitting it into ``limit`` tokens (None: no limit).

    ``name`` labels errors (the runner passes ``item 'id'``). Raises ConfigError when the prompt does not
    fit and ``truncate="error"``, or when even the question does not fit.
    """
    check_setting(setting)
    if truncate not in TRUNCATE:
        raise ValueError(f"truncate={truncate!r} is unknown; known: {list(TRUNCATE)}")
    context_ids = tokenizer(context, add_special_tokens=True).input_ids
    question_ids = tokenizer(question + answer_prefix, add_special_tokens=False).input_ids
    total = len(context_ids) + len(question_ids) + max_new_tokens
    truncated = limit is not None and total > limit
    if truncated:
        if truncate == "error":
            raise ConfigError(
                f"{name}: prompt + answer need {total} tokens > max_context_tokens={limit}; "
                "set truncate=middle or raise max_context_tokens"
            )
        keep = limit - len(question_ids) - max_new_tokens
        if keep < MIN_CONTEXT_TOKENS:
            raise ConfigError(f"{name}: the question alone does not fit in max_context_tokens={limit}")
        context_ids = context_ids[: keep // 2] + context_ids[len(context_ids) - (keep - keep // 2):]
    if setting == "question_aware":
        prefix, suffix = context_ids + question_ids, []
    else:
        prefix, suffix = context_ids, question_ids
    return PromptIds(torch.tensor([prefix], dtype=torch.long), torch.tensor([suffix], dtype=torch.long), truncated)


def model_limit(model, max_context_tokens: int | None = None) -> int:
    """The prompt limit: ``max_context_tokens`` capped at the model's ``max_position_embeddings``."""
    config = model.config.get_text_config(decoder=True)
    native = getattr(config, "max_position_embeddings", None) or 1 << 30
    return min(max_context_tokens or native, native)


__all__ = ["PromptIds", "SETTINGS", "build_prompt", "check_setting", "model_limit"]

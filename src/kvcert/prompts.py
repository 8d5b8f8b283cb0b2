"""How a (context, question, answer prefix) becomes token ids, the same way for ``kvcert.generate`` and the
cell runner, so that the library and the pipeline give the same answer for the same item.

The context is encoded with the tokenizer's special tokens, ``question + answer_prefix`` without them,
and the two are concatenated, so that both settings see identical token ids: ``question_aware`` prefills
all of it; ``streaming`` prefills the context and feeds the rest after compression (docs/METHOD.md §5).
A prompt that does not fit the model's window (with room for the answer) has the middle of its context
cut (``truncate="middle"``) or is refused (``truncate="error"``).

With ``chat_template=True`` the tokenizer's chat template frames the prompt as one user turn and the opening
of the assistant's, as kvpress's pipeline prompts a model: the template's text before the user's content,
then the context, make the prefix (encoded as one text, the template's own special tokens included and none
added); the question, the rest of the template (the end of the user turn, the assistant header and whatever
the template appends to it, e.g. Qwen3's empty thinking block with ``enable_thinking=False``) and the answer
prefix make the rest. So the streaming setting compresses the framed context alone and feeds the question
and the assistant prompt after it. A tokenizer without a template is refused (``ConfigError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError

SETTINGS = ("question_aware", "streaming")
# Marks where the user's content ends in a rendered template; a text holding it cannot be framed.
CONTENT_END = "\u27e6kvcert:end-of-context\u27e7"
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
    chat_template: bool = False,
) -> PromptIds:
    """Token ids of a prompt after fitting it into ``limit`` tokens (None: no limit).

    ``name`` labels errors (the runner passes ``item 'id'``). Raises ConfigError when the prompt does not
    fit and ``truncate="error"``, or when even the question does not fit, or (``chat_template=True``) when
    the tokenizer has no chat template. A truncated templated prompt keeps the template's opening whole and
    cuts the middle of the context after it.
    """
    check_setting(setting)
    if truncate not in TRUNCATE:
        raise ValueError(f"truncate={truncate!r} is unknown; known: {list(TRUNCATE)}")
    if chat_template:
        opening, closing = chat_frame(tokenizer, name)
        if CONTENT_END in context:
            raise ConfigError(f"{name}: the context holds {CONTENT_END!r}, the marker chat_template=true splits on")
        framed = tokenizer(opening + context, add_special_tokens=False).input_ids
        kept = _common_length(tokenizer(opening, add_special_tokens=False).input_ids, framed)
        head, context_ids = framed[:kept], framed[kept:]
        question_ids = tokenizer(question + closing + answer_prefix, add_special_tokens=False).input_ids
    else:
        head = []
        context_ids = tokenizer(context, add_special_tokens=True).input_ids
        question_ids = tokenizer(question + answer_prefix, add_special_tokens=False).input_ids
    total = len(head) + len(context_ids) + len(question_ids) + max_new_tokens
    truncated = limit is not None and total > limit
    if truncated:
        if truncate == "error":
            raise ConfigError(
                f"{name}: prompt + answer need {total} tokens > max_context_tokens={limit}; "
                "set truncate=middle or raise max_context_tokens"
            )
        keep = limit - len(head) - len(question_ids) - max_new_tokens
        if keep < MIN_CONTEXT_TOKENS:
            raise ConfigError(f"{name}: the question alone does not fit in max_context_tokens={limit}")
        context_ids = context_ids[: keep // 2] + context_ids[len(context_ids) - (keep - keep // 2):]
    context_ids = head + context_ids
    if setting == "question_aware":
        prefix, suffix = context_ids + question_ids, []
    else:
        prefix, suffix = context_ids, question_ids
    return PromptIds(torch.tensor([prefix], dtype=torch.long), torch.tensor([suffix], dtype=torch.long), truncated)


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` carries a chat template (``chat_template=True`` needs one)."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_frame(tokenizer, name: str = "prompt") -> tuple[str, str]:
    """(opening, closing): the text a tokenizer's chat template puts before and after the content of a lone user
    turn whose reply it opens (``add_generation_prompt=True``, ``enable_thinking=False``). Rendered around a
    marker; raises ConfigError when the tokenizer has no template or the template does not keep the content
    verbatim."""
    if not has_chat_template(tokenizer):
        raise ConfigError(f"{name}: chat_template=true, but the tokenizer {_tokenizer_name(tokenizer)} has no chat "
                          "template; set chat_template=false")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": CONTENT_END}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    if not isinstance(rendered, str) or rendered.count(CONTENT_END) != 1:
        raise ConfigError(f"{name}: chat_template=true, but the chat template of {_tokenizer_name(tokenizer)} does "
                          "not render a user turn's text verbatim once; set chat_template=false")
    opening, closing = rendered.split(CONTENT_END)
    return opening, closing


def _tokenizer_name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _common_length(a: list[int], b: list[int]) -> int:
    """The length of the longest common start of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def model_limit(model, max_context_tokens: int | None = None) -> int:
    """The prompt limit: ``max_context_tokens`` capped at the model's ``max_position_embeddings``."""
    config = model.config.get_text_config(decoder=True)
    native = getattr(config, "max_position_embeddings", None) or 1 << 30
    return min(max_context_tokens or native, native)


__all__ = ["CONTENT_END", "PromptIds", "SETTINGS", "build_prompt", "chat_frame", "check_setting", "has_chat_template",
           "model_limit"]

"""The evaluation item every workload produces (see the package docstring for the contract)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True, kw_only=True)
class Item:
    """One prompt with its references.

    The model reads ``context``, then ``question + answer_prefix`` (``kvcert.prompts.build_prompt`` encodes
    the two parts separately, the context with the tokenizer's special tokens; with ``chat_template=true`` the
    tokenizer's chat template frames them, context and question in one user turn, the answer prefix opening
    the assistant's):
    ``context`` is the part a streaming run compresses before the question is known;
    ``question`` and ``answer_prefix`` arrive afterwards and are never compressed.
    ``answer_prefix`` is text that opens the model's answer (RULER's "The pass key is"):
    in a chat format it belongs to the assistant turn, while ``question`` belongs to the
    user turn.

    ``metric_kwargs`` holds extra arguments the metric needs (LongBench's class list,
    first-line-only scoring); :func:`kvcert.data.score_item` passes them on.
    ``meta`` is free-form provenance (needle depths, source dataset) for analysis only;
    it takes no part in equality or hashing.
    """

    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    answer_prefix: str = ""
    max_new_tokens: int
    metric: str
    task: str
    metric_kwargs: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept a list (or a single string) for answers but store an immutable tuple,
        # so that a frozen Item really is immutable and hashable.
        answers = (self.answers,) if isinstance(self.answers, str) else tuple(self.answers)
        object.__setattr__(self, "answers", answers)

    @property
    def prompt(self) -> str:
        """The prompt as one text (for display and length checks; the model's token ids come from
        ``kvcert.prompts.build_prompt``, which encodes the context and the rest separately)."""
        return self.context + self.question + self.answer_prefix

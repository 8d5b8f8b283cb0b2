"""Workloads: the prompts the pipeline evaluates, and how their answers are scored.

Every workload yields :class:`Item` objects. The contract with the runner:

- the model reads ``item.context`` followed by ``item.question + item.answer_prefix``, encoded by
  ``kvcert.prompts.build_prompt`` (the context with the tokenizer's special tokens, the rest without; or,
  with ``chat_template=true``, framed by the tokenizer's chat template);
- ``context`` is the part that may be compressed before the question is known (the
  streaming / question-agnostic setting): the document or haystack, preceded by any
  template preamble (instructions that come before the document);
- ``question`` is the rest of the user's text (the question and any closing instruction),
  and ``answer_prefix`` the text that opens the model's answer (e.g. " The pass key is");
  neither is ever compressed, and in a chat format ``answer_prefix`` belongs to the
  assistant turn;
- generation stops after ``max_new_tokens`` tokens; the prediction (the generated text
  only, without ``answer_prefix``) is scored with ``score_item(item, prediction)``, i.e.
  ``metrics.score(prediction, item.answers, item.metric, **item.metric_kwargs)`` on a 0–100
  scale, and ``metrics.is_correct(score, item.metric)`` says whether it counts as right.

Workloads (``load_items(name, cfg, tokenizer, n_items)``):

- ``ruler``: synthetic needle / variable-tracking / common-words tasks generated here to a
  token length of the given tokenizer (:mod:`kvcert.data.ruler`);
- ``longbench``: LongBench v1 subsets with the benchmark's prompts, truncation and metrics
  (:mod:`kvcert.data.longbench`);
- ``jsonl``: ready-made items from a JSON-lines file (:mod:`kvcert.data.jsonl`).
"""

from __future__ import annotations

from collections import defaultdict

from .item import Item
from .metrics import CORRECT_THRESHOLDS, METRICS, is_correct, score, score_item
from .registry import WORKLOADS, load_items, register_workload

SHARD_BY = ("item", "task")


def shard_items(items: list[Item], shard: int, n_shards: int, by: str = "item") -> list[Item]:
    """Shard ``shard`` of ``n_shards`` of a workload's items, in workload order.

    ``by="item"``: items shard, shard + n_shards, … of the workload (every committed record was sharded
    so). ``by="task"``: the same within each task, so that every shard holds the workload's mix of tasks.
    Calibration needs the latter: the generators interleave tasks round-robin, so the ``item`` shards of a
    two-task workload split in two are one task each, a task shift rather than exchangeable halves.
    """
    if by == "item":
        return items[shard::n_shards]
    if by != "task":
        raise ValueError(f"shard_by={by!r} is unknown; known: {list(SHARD_BY)}")
    seen: dict[str, int] = defaultdict(int)
    kept = []
    for item in items:
        if seen[item.task] % n_shards == shard:
            kept.append(item)
        seen[item.task] += 1
    return kept

__all__ = [
    "CORRECT_THRESHOLDS",
    "Item",
    "METRICS",
    "SHARD_BY",
    "WORKLOADS",
    "is_correct",
    "load_items",
    "register_workload",
    "score",
    "score_item",
    "shard_items",
]

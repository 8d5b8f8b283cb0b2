"""Items from any JSON-lines file (``data=jsonl data.path=FILE``).

One JSON object per line::

    {"id": "q1", "context": "...", "question": "...", "answers": ["..."],
     "answer_prefix": "...", "max_new_tokens": 16, "metric": "qa_f1", "task": "my_task"}

``id``, ``context``, ``question`` and ``answers`` are required; ``answers`` is a list of
strings or one string. The optional keys default to the config values ``answer_prefix``
(""), ``max_new_tokens`` (32), ``metric`` (``string_match_part``: any one answer found in
the prediction counts) and ``task`` (``default_task``, below). Blank lines are skipped; any
other line that is not a valid item stops loading with a one-line ``ValueError`` naming the
file, the line number and the item id when it is known.

A record's task is its own ``task`` key, else ``data.task``, else the file's: its name without
the extension and without a trailing split name (``SPLITS``, after ``-``, ``_`` or ``.``), and
for a file named by its split alone, its folder's name. So ``qa-cal.jsonl`` and
``qa_eval.jsonl``, or ``qa/cal.jsonl`` and ``qa/eval.jsonl``, are both task ``qa``: one workload
split into a calibration file and an evaluation file is one task, and a calibration fitted on
one file serves the other; ``qa-cal.jsonl`` and ``summaries-eval.jsonl`` are two tasks, and
kvcert-run refuses a calibration fitted on one for the other (``Calibration.check_prompts``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from .item import Item
from .metrics import METRICS

CONFIG_KEYS = {"name", "path", "answer_prefix", "max_new_tokens", "metric", "task", "n_items"}
DEFAULTS = {"answer_prefix": "", "max_new_tokens": 32, "metric": "string_match_part"}
REQUIRED = ("id", "context", "question", "answers")
# Names of a workload's splits that a file name may end with; what precedes them names the task.
SPLITS = ("cal", "calib", "calibration", "dev", "eval", "evaluation", "heldout", "test", "train", "val", "valid",
          "validation")
_SPLIT_SUFFIX = re.compile(rf"(?:^|[-_.])(?:{'|'.join(SPLITS)})$", re.IGNORECASE)


def default_task(path: str | Path) -> str:
    """The task of a file's records that name none: the file name without its extension and trailing split
    name, or the folder's name for a file named by its split alone (``qa/eval.jsonl`` -> ``qa``)."""
    path = Path(path)
    return _SPLIT_SUFFIX.sub("", path.stem) or path.resolve().parent.name or path.stem


class _LineError(Exception):
    """A problem with one line; turned into a ValueError with the file position."""


def _require_str(record: Mapping[str, Any], key: str, *, allow_empty: bool) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise _LineError(f"'{key}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise _LineError(f"'{key}' is empty")
    return value


def _parse_record(record: Any, defaults: Mapping[str, Any], default_task: str) -> Item:
    if not isinstance(record, dict):
        raise _LineError(f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise _LineError(f"missing key(s) {', '.join(missing)}")
    item_id = record["id"]
    if isinstance(item_id, int) and not isinstance(item_id, bool):
        item_id = str(item_id)
    if not isinstance(item_id, str) or not item_id:
        raise _LineError("'id' must be a non-empty string")
    context = _require_str(record, "context", allow_empty=False)
    question = _require_str(record, "question", allow_empty=True)

    answers = record["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise _LineError("'answers' must be a string or a list of strings")
    if not answers or not any(a.strip() for a in answers):
        raise _LineError("'answers' is empty")

    answer_prefix = record.get("answer_prefix", defaults["answer_prefix"])
    if not isinstance(answer_prefix, str):
        raise _LineError("'answer_prefix' must be a string")
    max_new_tokens = record.get("max_new_tokens", defaults["max_new_tokens"])
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise _LineError("'max_new_tokens' must be a positive integer")
    metric = record.get("metric", defaults["metric"])
    if metric not in METRICS:
        raise _LineError(f"unknown metric {metric!r} (known: {', '.join(sorted(METRICS))})")
    task = record.get("task", defaults.get("task") or default_task)
    if not isinstance(task, str):
        raise _LineError("'task' must be a string")
    return Item(id=item_id, context=context, question=question, answers=tuple(answers),
                answer_prefix=answer_prefix, max_new_tokens=max_new_tokens, metric=metric, task=task,
                meta={"source": "jsonl"})


def read_jsonl_items(path: str | Path, defaults: Mapping[str, Any] | None = None) -> list[Item]:
    """Parse and validate every line of ``path`` into :class:`Item` objects."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"jsonl items file not found: {path}")
    merged = {**DEFAULTS, **(defaults or {})}
    task = default_task(path)
    items: list[Item] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record: Any = None
            try:
                record = json.loads(line.rstrip("\r\n"))
                item = _parse_record(record, merged, task)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
            except _LineError as err:
                known_id = record.get("id") if isinstance(record, dict) else None
                where = f"{path}:{lineno}" + (f" (item {known_id!r})" if known_id is not None else "")
                raise ValueError(f"{where}: {err}") from None
            if item.id in seen:
                raise ValueError(f"{path}:{lineno} (item {item.id!r}): duplicate id, first seen on line {seen[item.id]}")
            seen[item.id] = lineno
            items.append(item)
    return items


def load_jsonl(cfg: Mapping[str, Any], tokenizer: Any, n_items: int | None) -> list[Item]:
    """Registry entry for ``data=jsonl``; the tokenizer is not needed for ready-made items."""
    unknown = set(cfg) - CONFIG_KEYS
    if unknown:
        raise ValueError(f"data=jsonl: unknown option(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(CONFIG_KEYS))}")
    if not cfg.get("path"):
        raise ValueError("data=jsonl needs data.path=FILE (a JSON-lines file of items)")
    defaults = {k: cfg[k] for k in ("answer_prefix", "max_new_tokens", "metric", "task") if cfg.get(k) is not None}
    return read_jsonl_items(cfg["path"], defaults)

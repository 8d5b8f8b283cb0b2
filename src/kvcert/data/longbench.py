"""LongBench v1 (THUDM/LongBench) English subsets as :class:`Item` lists.

Sources, in order:

- ``path`` (local, nothing downloaded): a JSON-lines file in LongBench's record schema
  (``input, context, answers, length, dataset, language, all_classes, _id``; the subset of
  each record is its ``dataset`` field), a directory of ``{subset}.jsonl`` files, or the
  benchmark's ``data.zip`` (``data/{subset}.jsonl`` inside).
- otherwise the Hugging Face hub: ``datasets.load_dataset(hub_id, subset, split=split)``;
  recent ``datasets`` releases no longer run the repository's loading script, so on failure
  the same records are read from the repository's ``data.zip``. Without network either way
  ends in a one-line ``RuntimeError`` that says to set ``path``.

Prompts are LongBench's own templates (``assets/longbench.yaml``, with the per-subset
generation lengths and metrics). The template text up to and including the document is the
:attr:`Item.context`; the rest, with the record's ``input`` filled in, is the
:attr:`Item.question` (LongBench has no answer prefix).

Truncation follows LongBench: a prompt longer than ``max_context_tokens`` tokens keeps its
first half and its last half of the budget and drops the middle. Since the question sits at
the end, only the document is cut; the truncated prompt has at most ``max_context_tokens``
tokens (encoded without special tokens).

Config keys: ``subsets`` (default: the six QA subsets with a local path absent, every subset
found with one), ``path``, ``hub_id`` ("THUDM/LongBench"), ``split`` ("test"),
``max_context_tokens`` (6000; null keeps whole prompts). Subsets are interleaved
round-robin, so the first ``n_items`` items cover every subset.
"""

from __future__ import annotations

import json
import zipfile
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from .item import Item

CONFIG_KEYS = {"name", "subsets", "path", "hub_id", "split", "max_context_tokens", "n_items"}
DEFAULTS: dict[str, Any] = {
    "hub_id": "THUDM/LongBench",
    "split": "test",
    "max_context_tokens": 6000,
    "subsets": ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"],
}
RECORD_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


@lru_cache(maxsize=1)
def subset_specs() -> dict[str, dict[str, Any]]:
    """Prompt template, generation length and metric of every supported subset."""
    text = resources.files("kvcert.data").joinpath("assets/longbench.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _base_subset(subset: str) -> str:
    # LongBench-E subsets ("qasper_e") share the templates of their LongBench counterpart.
    return subset[:-2] if subset.endswith("_e") and subset[:-2] in subset_specs() else subset


def _check_subset(subset: str) -> None:
    if _base_subset(subset) not in subset_specs():
        raise ValueError(f"unknown LongBench subset {subset!r}; known subsets: {', '.join(subset_specs())} "
                         f"(and their LongBench-E variants ending in _e)")


# ----------------------------------------------------------------------------- reading


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0].rstrip('.') if text else ''}"


def _validate(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object in LongBench's schema")
    missing = [f for f in RECORD_FIELDS if f not in record]
    if missing:
        raise ValueError(f"{where}: missing LongBench field(s) {', '.join(missing)}")
    answers = record["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where} (item {record['_id']!r}): 'answers' must be a non-empty list of strings")
    for key in ("input", "context", "dataset", "_id"):
        if not isinstance(record[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string")
    if not record["context"].strip():
        raise ValueError(f"{where} (item {record['_id']!r}): empty 'context'")
    return record


def _read_lines(lines: Iterator[str], source: str) -> Iterator[dict[str, Any]]:
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
        yield _validate(record, where)


def _records_from_path(path: Path, subsets: list[str] | None) -> dict[str, list[dict[str, Any]]]:
    """Records by subset from a local JSON-lines file, directory or data.zip."""
    by_subset: dict[str, list[dict[str, Any]]] = {}
    if path.is_dir():
        files = sorted(path.glob("*.jsonl")) + sorted(path.glob("data/*.jsonl"))
        for file in files:
            if subsets is None or file.stem in subsets:
                with file.open(encoding="utf-8") as handle:
                    by_subset.setdefault(file.stem, []).extend(_read_lines(handle, str(file)))
    elif path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for member in sorted(archive.namelist()):
                stem = Path(member).stem
                if member.endswith(".jsonl") and (subsets is None or stem in subsets):
                    text = archive.read(member).decode("utf-8")
                    by_subset.setdefault(stem, []).extend(_read_lines(iter(text.splitlines()), f"{path}!{member}"))
    elif path.is_file():
        with path.open(encoding="utf-8") as handle:
            for record in _read_lines(handle, str(path)):
                if subsets is None or record["dataset"] in subsets:
                    by_subset.setdefault(record["dataset"], []).append(record)
    else:
        raise FileNotFoundError(f"LongBench data not found: {path}")
    return by_subset


def _records_from_hub(hub_id: str, subset: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ImportError("data=longbench without data.path needs the optional dependency 'datasets' "
                          "(pip install 'kvcert[data]'), or set data.path to a local copy") from None
    try:
        rows = datasets.load_dataset(hub_id, subset, split=split)
        return [_validate(dict(row), f"{hub_id}/{subset}[{i}]") for i, row in enumerate(rows)]
    except Exception as err:  # noqa: BLE001 - any failure falls back to data.zip, then reports both
        first_error = err
    try:
        from huggingface_hub import hf_hub_download

        archive = hf_hub_download(hub_id, "data.zip", repo_type="dataset")
        records = _records_from_path(Path(archive), [subset]).get(subset)
        if records:
            return records
        raise ValueError(f"data.zip has no {subset}.jsonl")
    except Exception as err:  # noqa: BLE001
        raise RuntimeError(
            f"LongBench subset {subset!r} could not be fetched from the Hugging Face hub ({hub_id}): "
            f"{_one_line(first_error)}; fallback data.zip: {_one_line(err)}. Set data.path to a local copy "
            f"(LongBench JSON lines, a directory of them, or data.zip)") from None


# ----------------------------------------------------------------------------- prompts


def split_template(template: str, record: Mapping[str, Any]) -> tuple[str, str]:
    """The (context, question) halves of a filled LongBench template.

    ``str.replace`` rather than ``str.format``: documents and code contain braces.
    """
    head, tail = template.split("{context}", 1)
    return head + record["context"], tail.replace("{input}", record["input"])


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def truncate_middle(context: str, question: str, tokenizer: Any, budget: int | None) -> tuple[str, int, bool]:
    """Cut the middle of ``context`` so that ``context + question`` fits ``budget`` tokens.

    Returns (context, prompt tokens, truncated?). Like LongBench, the prompt keeps
    ``budget // 2`` tokens from its start and the rest of the budget from its end.
    """
    n_prompt = _count(tokenizer, context + question)
    if budget is None or n_prompt <= budget:
        return context, n_prompt, False
    ids = tokenizer.encode(context, add_special_tokens=False)
    question_tokens = n_prompt - len(ids)
    head = budget // 2
    tail = budget - head - question_tokens
    if tail < 0:
        raise ValueError(f"max_context_tokens={budget} is too small: the question part alone has "
                         f"{question_tokens} tokens, more than half the budget")
    # Re-tokenizing across the cut can add a token or two; shorten the head until it fits.
    for _ in range(8):
        kept = tokenizer.decode(ids[:head], skip_special_tokens=True)
        if tail:
            kept += tokenizer.decode(ids[len(ids) - tail:], skip_special_tokens=True)
        n_prompt = _count(tokenizer, kept + question)
        if n_prompt <= budget:
            return kept, n_prompt, True
        head -= n_prompt - budget
    raise ValueError(f"could not truncate a prompt to {budget} tokens")


def record_to_item(record: Mapping[str, Any], subset: str, tokenizer: Any, budget: int | None) -> Item:
    """One LongBench record as an :class:`Item` (template, truncation, metric)."""
    spec = subset_specs()[_base_subset(subset)]
    context, question = split_template(spec["prompt"], record)
    context, n_tokens, truncated = truncate_middle(context, question, tokenizer, budget)
    metric_kwargs: dict[str, Any] = {}
    if spec["metric"] == "classification":
        metric_kwargs["all_classes"] = list(record["all_classes"] or [])
    if spec.get("first_line"):
        metric_kwargs["first_line"] = True
    return Item(
        id=f"longbench/{subset}/{record['_id']}",
        context=context,
        question=question,
        answers=tuple(record["answers"]),
        answer_prefix="",
        max_new_tokens=int(spec["max_new_tokens"]),
        metric=spec["metric"],
        task=subset,
        metric_kwargs=metric_kwargs,
        meta={"length": record.get("length"), "language": record.get("language"),
              "group": spec.get("group"), "truncated": truncated, "prompt_tokens": n_tokens},
    )


# ----------------------------------------------------------------------------- entry point


def _interleave(by_subset: dict[str, list[dict[str, Any]]], order: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Round-robin over subsets (skipping exhausted ones), each in its own record order."""
    out: list[tuple[str, dict[str, Any]]] = []
    depth = 0
    while True:
        added = False
        for subset in order:
            records = by_subset.get(subset, [])
            if depth < len(records):
                out.append((subset, records[depth]))
                added = True
        if not added:
            return out
        depth += 1


def load_longbench(cfg: Mapping[str, Any], tokenizer: Any, n_items: int | None) -> list[Item]:
    """Registry entry for ``data=longbench``."""
    unknown = set(cfg) - CONFIG_KEYS
    if unknown:
        raise ValueError(f"data=longbench: unknown option(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(CONFIG_KEYS))}")
    settings = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "max_context_tokens"}}
    if "subsets" not in cfg or cfg.get("subsets") is None:
        settings["subsets"] = None if cfg.get("path") else DEFAULTS["subsets"]
    subsets = settings["subsets"]
    if isinstance(subsets, str):
        subsets = [subsets]
    for subset in subsets or []:
        _check_subset(subset)
    budget = settings["max_context_tokens"]
    budget = None if budget is None else int(budget)

    if cfg.get("path"):
        by_subset = _records_from_path(Path(cfg["path"]), subsets)
        if subsets is None:
            for subset in by_subset:
                _check_subset(subset)
            subsets = sorted(by_subset)
        empty = [s for s in subsets if not by_subset.get(s)]
        if empty:
            raise ValueError(f"LongBench data at {cfg['path']} has no records for subset(s) {', '.join(empty)}")
    else:
        by_subset = {s: _records_from_hub(settings["hub_id"], s, settings["split"]) for s in subsets}

    chosen = _interleave(by_subset, list(subsets))
    if n_items is not None:
        if n_items < 0:
            raise ValueError(f"n_items must be >= 0, got {n_items}")
        if n_items > len(chosen):
            raise ValueError(f"data=longbench: n_items={n_items} requested but only {len(chosen)} items "
                             f"are available in {', '.join(subsets)}")
        chosen = chosen[:n_items]
    return [record_to_item(record, subset, tokenizer, budget) for subset, record in chosen]


# ----------------------------------------------------------------------------- a local copy


def write_copy(by_subset: Mapping[str, list[dict[str, Any]]], out_dir: str | Path) -> Path:
    """Write records as ``{subset}.jsonl`` files in a new directory ``out_dir`` (a complete copy or none).

    The files go to a temporary sibling directory first, which is renamed once every file is written.
    """
    from ..atomic import new_directory

    with new_directory(out_dir) as tmp:
        for subset, records in by_subset.items():
            with open(tmp / f"{subset}.jsonl", "w", encoding="utf-8") as handle:
                for record in records:
                    handle.write(json.dumps({k: record[k] for k in RECORD_FIELDS}, ensure_ascii=False) + "\n")
    return Path(out_dir)


def fetch_main(argv: list[str] | None = None) -> int:
    """``kvcert-fetch-longbench --subsets a,b --out DIR``: a local LongBench copy for ``data.path``.

    Reads the subsets from the Hugging Face hub (needs the network) and writes one JSON-lines file per
    subset in LongBench's record schema, which ``data=longbench data.path=DIR`` then reads offline.
    """
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="kvcert-fetch-longbench", description=fetch_main.__doc__.split("\n\n")[0])
    parser.add_argument("--subsets", default=",".join(DEFAULTS["subsets"]), help="comma-separated subset names")
    parser.add_argument("--out", required=True, help="directory to create ({subset}.jsonl files)")
    parser.add_argument("--hub-id", default=DEFAULTS["hub_id"])
    parser.add_argument("--split", default=DEFAULTS["split"])
    args = parser.parse_args(argv)
    subsets = [s.strip() for s in args.subsets.split(",") if s.strip()]
    try:
        if not subsets:
            raise ValueError("--subsets is empty")
        for subset in subsets:
            _check_subset(subset)
        by_subset = {s: _records_from_hub(args.hub_id, s, args.split) for s in subsets}
        out = write_copy(by_subset, args.out)
    except (ValueError, RuntimeError, ImportError, OSError) as err:
        print(f"kvcert-fetch-longbench: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{s} {len(r)}" for s, r in by_subset.items())
    print(f"kvcert-fetch-longbench: wrote {out} ({counts} records)", file=sys.stderr)
    return 0

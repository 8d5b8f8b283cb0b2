"""The numbers of README.md and docs/studies/*.md, rendered from the committed tables so that none is typed by
hand. A page marks each number it states and each generated block:

    <!-- value:claims study=v4 claim=c1 ci .1f -->−17.5 [−19.4, −15.5]<!-- /value -->
    <!-- block:results-grid:start --> ... <!-- block:results-grid:end -->

A value's key reads ``SOURCE FIELD=VALUE ... COLUMN [FORMAT]``: the table (SOURCES below), the row (every
FIELD=VALUE must match, every FIELD!=VALUE must not; quote a value holding spaces), the column and a Python format spec (default .4g; ``s``: the cell as it is).
Column ``min(COLUMN)`` or ``max(COLUMN)`` takes the extreme over
every matching row; ``max(min(COLUMN)/GROUP)`` the largest over GROUP's values of the smallest within each (a
worst layer's best budget). Column ``ci`` is the estimate with its 95% interval, "x [lo, hi]"; ``COLUMN~ci`` does the same for a column
whose bounds are COLUMN_lo and COLUMN_hi (the sensitivity table) or for a claim JSON's nested interval
(``details.gain_over_confidence~ci``); ``width()`` or ``width(NAME)`` is such an interval's width. Minus signs
are rendered as "−". Source
``accuracy`` pools the matching rows of accuracy.csv over what the key leaves open (weighted by n; column n
is their sum). Source ``table file=PATH`` reads any CSV under the results folder (an exploratory study's
tables). Source ``by_policy`` is results/claims_by_policy.csv (one row per study, claim, model and
component of a per-configuration claim). Blocks: ``results-grid`` (one row per claim, one column per study; also written to
results/claims_grid.md) and ``by-policy-<study>[-<model>]`` (a study's C2 and C3 per scorer, allocator and
certain-head share, from results/claims_by_policy.csv; pooled over the models unless a model is named).

An ``include`` span holds a committed report under the results folder as it is (a benchmark's table):
``<!-- include:calibration/tradeoff.md -->`` ... ``<!-- /include -->``. Source ``md_table file=PATH [table=N]``
reads the rows of a committed markdown report's tables. A ``rows`` span renders a table's body, one template line per row of a source (``rows``):

    <!-- rows:table file=sensitivity/sensitivity.csv
    | {knob} | {value} | {budget:g} | {acc_full:.1f} |
    -->
    ...the rendered lines...
    <!-- /rows -->

Beside the results, a value may read a locked or committed file of the repository: ``yaml file=PATH KEY.PATH``
(a pre-registration's YAML, a scale; nested keys joined by dots, a list's items by position, a claim by its id)
and ``const file=PATH NAME`` (a module-level literal of a Python file, read without importing it; ``NAME.N``
the Nth item, from 0, of a tuple or list).

Run by rule ``render_docs`` (workflow/rules/tables.smk: README.md and docs/studies/*.md), part of the default
target, or for every page (docs/*.md included) by ``make render-docs``:
    python workflow/scripts/render_docs.py results --grid results/claims_grid.md README.md docs/*.md docs/studies/*.md
``--count`` writes nothing and prints each page's hand-written numbers: those outside spans, blocks and the
short list DEFINITIONS (``make doc-numbers``; tests/test_doc_numbers.py holds every page to its count).
"""

import argparse
import ast
import csv
import json
import re
import shlex
import string
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path

from kvcert.atomic import write_text_atomic

VALUE = re.compile(r"<!-- value:(?P<key>.+?) -->(?P<shown>.*?)<!-- /value -->", re.S)
BLOCK = re.compile(r"(?P<open><!-- block:(?P<name>[\w-]+):start -->\n)(?P<shown>.*?)(?P<close><!-- block:(?P=name):end -->)",
                   re.S)
MINUS = "−"
GRID_COLUMNS = {"study", "prereg", "claim", "title", "component", "estimate", "ci_low", "ci_high", "threshold",
                "verdict", "paper_verdict"}


class DocError(ValueError):
    pass


# --- sources: a key's table, as a list of row dicts ------------------------------------------------------------


def _csv(path):
    if not Path(path).is_file():
        raise DocError(f"{path}: no such table")
    return [dict(r) for r in _read_csv(str(path))]


@lru_cache(maxsize=None)  # a page reads the same few tables hundreds of times
def _read_csv(path):
    with open(path, newline="") as handle:
        return tuple(csv.DictReader(handle))


def _claim_json(results, fields):
    """One claim JSON (``study=``, ``claim=``) flattened to one row: nested keys joined by dots."""
    study, claim = fields.pop("study", None), fields.pop("claim", None)
    if not study or not claim:
        raise DocError("claim_json needs study= and claim=")
    path = results / study / "claims" / f"{claim}.json"
    if not path.is_file():
        raise DocError(f"{path}: no such claim")
    return [dict(_flat_file(str(path), *_stamp(path)))]


def _stamp(path):
    """(mtime_ns, size) of ``path``: part of _flat_file's cache key, so a rewritten file is read again."""
    stat = Path(path).stat()
    return stat.st_mtime_ns, stat.st_size


@lru_cache(maxsize=None)  # a page's spans read the same few JSON and YAML files hundreds of times
def _flat_file(path, mtime_ns, size):
    """A JSON (.json) or YAML file flattened to one row (``_flat``), read once per version of the file."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        return _flat(json.loads(text))
    import yaml

    return _flat(yaml.safe_load(text))


def _flat(document):
    """A JSON or YAML document as one row: nested keys joined by dots; a list of mappings that each have a
    ``name`` (a claim's components) or an ``id`` (a pre-registration's claims) is keyed by it, a list of scalars
    is also keyed by position."""
    flat = {}

    def walk(prefix, value):
        for name in ("name", "id"):  # a claim's components by name; a pre-registration's claims by id
            if isinstance(value, list) and value and all(isinstance(v, dict) and name in v for v in value):
                value = {v[name]: v for v in value}
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value
            if isinstance(value, list):  # a list of scalars also by position: budgets.0
                for i, v in enumerate(value):
                    walk(f"{prefix}{i}.", v)
                for v in value:  # a scale's overrides also by key: overrides.n_items, overrides.budgets
                    if isinstance(v, str) and re.fullmatch(r"[\w.]+=.+", v):
                        key, text = v.split("=", 1)
                        if f"{prefix}{key}" not in flat:
                            walk(f"{prefix}{key}.", _override_value(text))
    walk("", document)
    return flat


def _override_value(text):
    """An override's value as YAML reads it (120, [0.1,0.25], null, Hydra's {snapkv:{kernel_size:9}}), else the
    text."""
    import yaml

    if text[:1] in "[{":  # Hydra writes a mapping's key:value without the space YAML wants
        text = re.sub(r"(?<=[\w}]):(?=[\w{\[])", ": ", text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _manifests(results, study, cell="*"):
    """A study's committed cell manifests, of the cells whose folder name matches the glob ``cell``."""
    return sorted((results / str(study)).glob(f"cells/{cell}/shard-*/manifest.json"))


def _cells(results, fields):
    """A study's committed cell manifests (``study=``; ``cell=`` a glob on the cell's folder, default every
    cell) as one row: count (manifests), seconds (their summed ``wall_seconds.total``), minutes_on_2_cores
    (seconds / 120: two cells at a time), items (items the shards hold), resumed (items a resumed shard took
    from its checkpoint, untimed) and seconds_per_item (seconds over the items the manifests time)."""
    study, cell = fields.pop("study", None), fields.pop("cell", "*")
    paths = _manifests(results, study, cell)
    if not paths:
        raise DocError(f"cells: no manifests under {results / str(study)}/cells/{cell}")
    manifests = [json.loads(p.read_text()) for p in paths]
    seconds = sum(m["wall_seconds"]["total"] for m in manifests)
    items = sum(m["n_shard_items"] for m in manifests)
    resumed = sum(m.get("n_resumed_items") or 0 for m in manifests)
    return [{"count": len(paths), "seconds": seconds, "minutes_on_2_cores": seconds / 120, "items": items,
             "resumed": resumed, "seconds_per_item": seconds / (items - resumed)}]


def _yaml(results, fields):
    """A committed YAML file (``file=``, relative to the repository: the folder above ``results``) flattened to
    one row like a claim JSON (a pilot, power or design output of a pre-registration)."""
    name = fields.pop("file", None)
    path = results.resolve().parent / str(name)
    if not name or not path.is_file():
        raise DocError(f"yaml: no such file {name!r} (file= is relative to the repository)")
    return [dict(_flat_file(str(path), *_stamp(path)))]


def _table(results, fields):
    """Any committed CSV table under ``results`` (``file=``, relative to it: an exploratory study's tables)."""
    name = fields.pop("file", None)
    if not name:
        raise DocError("table needs file= (a CSV path relative to the results folder)")
    return _csv(results / str(name))


def _const(results, fields):
    """The constants of a Python file (``file=``, relative to the repository: a module under src/kvcert or a
    script under workflow/scripts) as one row, read from its source without importing it: every top-level
    ``NAME = literal`` (tuple assignments ``A, B = 1, 2`` included) whose value ``ast.literal_eval`` reads, and a
    class's as ``Class.NAME``. A tuple or list is shown as its items, each in the key's format, joined by ", "."""
    name = fields.pop("file", None)
    path = results.resolve().parent / str(name)
    if not name or not path.is_file() or path.suffix != ".py":
        raise DocError(f"const: no such Python file {name!r} (file= is relative to the repository)")
    return [_constants(str(path))]


@lru_cache(maxsize=None)
def _constants(path):
    return _literals(ast.parse(Path(path).read_text(encoding="utf-8")).body)


def _literals(body, prefix=""):
    """``NAME = literal`` assignments of a module's or a class's body; a class's as ``Class.NAME`` (a dataclass
    field's default, also where a call gives it: the first argument or ``default=`` of ``knob(4, "...")`` or
    ``field(default=4)``; a call without a literal there, such as ``field(default_factory=list)``, is left out)."""
    row = {}
    for node in body:
        if isinstance(node, ast.ClassDef) and not prefix:
            row.update(_literals(node.body, f"{node.name}."))
            continue
        target, value = (node.targets[0], node.value) if isinstance(node, ast.Assign) and len(node.targets) == 1 \
            else (node.target, node.value) if isinstance(node, ast.AnnAssign) and node.value is not None else (None, None)
        names = [target] if isinstance(target, ast.Name) else list(target.elts) if isinstance(target, ast.Tuple) else []
        values = [value] if isinstance(target, ast.Name) else list(getattr(value, "elts", []))
        if len(names) != len(values) or not all(isinstance(n, ast.Name) for n in names):
            continue
        for n, v in zip(names, values):
            if prefix and isinstance(v, ast.Call):  # a dataclass field: knob(DEFAULT, ...), field(default=DEFAULT)
                v = next((k.value for k in v.keywords if k.arg == "default"), v.args[0] if v.args else v)
            try:
                row[prefix + n.id] = ast.literal_eval(v)
            except ValueError:
                continue
    return row


def _md_table(results, fields):
    """The body rows of the markdown tables of a committed markdown file under ``results`` (``file=``; ``table=N``
    the Nth table only, from 1), each keyed by its table's header cells (a benchmark's or a check's report)."""
    name, which = fields.pop("file", None), fields.pop("table", None)
    path = results / str(name)
    if not name or not path.is_file():
        raise DocError(f"md_table: no such file {name!r} (file= is relative to the results folder)")
    tables = markdown_tables(path.read_text(encoding="utf-8"))
    if which is not None:
        if not str(which).isdigit() or not 1 <= int(which) <= len(tables):
            raise DocError(f"md_table: {name} has {len(tables)} tables, no table={which}")
        tables = [tables[int(which) - 1]]
    return [dict(zip(header, cells)) for header, body in tables for cells in body]


def markdown_tables(page_text):
    """Every markdown table of a text: [(header cells, body rows of cells)], cells stripped, escaped pipes kept."""
    tables, current = [], None
    for line in page_text.splitlines():
        if line.startswith("|"):
            cells = [c.strip().replace("\0", "|") for c in line.replace("\\|", "\0").strip("|").split("|")]
            if current is None:
                current = (cells, [])
                tables.append(current)
            elif not set("".join(cells)) <= set("-: "):
                current[1].append(cells)
        else:
            current = None
    return tables


def _probes(results, fields):
    """The task probes' tables (results/probes/*.csv), one row per model and task."""
    paths = sorted((results / "probes").glob("*.csv"))
    if not paths:
        raise DocError(f"{results / 'probes'}: no probe tables")
    return [row for path in paths for row in _csv(path)]


# SOURCE -> (results, the key's row fields) -> rows. Fields a source consumes are popped.
SOURCES = {
    "claims": lambda results, fields: _csv(results / "claims.csv"),
    "by_model": lambda results, fields: _csv(results / "claims_by_model.csv"),
    "reproduction": lambda results, fields: _csv(results / "reproduction.csv"),
    "accuracy": lambda results, fields: _csv(results / "accuracy.csv"),
    "sensitivity": lambda results, fields: _csv(results / "sensitivity" / "sensitivity.csv"),
    "claim_json": _claim_json,
    "cells": _cells,
    "yaml": _yaml,
    "const": _const,
    "md_table": _md_table,
    "probes": _probes,
    "table": _table,
    "by_policy": lambda results, fields: _csv(results / "claims_by_policy.csv"),
}


def source_files(results, key):
    """The files a value's key reads (the rule's inputs)."""
    source, fields, _, _ = parse(key)
    return _files(Path(results), source, fields)


def _files(results, source, fields):
    """The files source ``source`` reads for a key's ``fields``."""
    if source == "claim_json":
        return [results / fields["study"] / "claims" / f"{fields['claim']}.json"]
    if source == "cells":
        return _manifests(results, fields["study"], fields.get("cell", "*"))
    if source in ("yaml", "const"):
        return [results.resolve().parent / fields["file"]]
    if source == "probes":
        return sorted((results / "probes").glob("*.csv"))
    if source in ("table", "md_table"):
        return [results / fields["file"]]
    return [results / {"claims": "claims.csv", "by_model": "claims_by_model.csv", "accuracy": "accuracy.csv",
                       "reproduction": "reproduction.csv", "sensitivity": "sensitivity/sensitivity.csv",
                       "by_policy": "claims_by_policy.csv"}[source]]


# --- values ------------------------------------------------------------------------------------------------------


def parse(key):
    """``SOURCE FIELD=VALUE ... COLUMN [FORMAT]`` -> (source, {field: value}, column, format)."""
    try:
        words = shlex.split(key)
    except ValueError as err:
        raise DocError(f"value key {key!r}: {err}") from None
    if not words or words[0] not in SOURCES:
        raise DocError(f"value key {key!r}: unknown source; known: {', '.join(SOURCES)}")
    fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    rest = [w for w in words[1:] if "=" not in w]
    if len(rest) not in (1, 2):
        raise DocError(f"value key {key!r}: want one column and at most one format after the fields")
    return words[0], fields, rest[0], rest[1] if len(rest) == 2 else ".4g"


def _same(cell, wanted):
    try:
        return float(cell) == float(wanted)
    except (TypeError, ValueError):
        return str(cell) == wanted


def _matches(row, fields):
    """Whether ``row`` matches every FIELD=VALUE of a key; a field written FIELD!=VALUE (parsed as ``FIELD!``)
    matches a row whose FIELD differs from VALUE (``width!=inf``: the finite widths), one written FIELD~=REGEX a row
    whose whole FIELD the regular expression matches (``policy~=[a-z0-9_]+``: the scorers without a defense)."""
    for k, v in fields.items():
        if k.endswith("~"):
            try:
                if k[:-1] not in row or not re.fullmatch(v, str(row[k[:-1]])):
                    return False
            except re.error as err:
                raise DocError(f"field {k}={v!r}: not a regular expression ({err})") from None
            continue
        name, equal = (k[:-1], False) if k.endswith("!") else (k, True)
        if name not in row or _same(row[name], v) != equal:
            return False
    return True


def _number(value, spec):
    value = float(value)
    if spec.endswith("d"):
        if value != round(value):
            raise DocError(f"format {spec!r} wants a whole number, got {value}")
        value = int(round(value))
    shown = format(value, spec)
    if spec.endswith("e"):  # 1e-05 -> 1e-5
        shown = re.sub(r"e([+-])0*(\d)", lambda m: f"e{m[1].replace('+', '')}{m[2]}", shown)
    return shown.replace("-", MINUS)


def _interval(row, name):
    """The columns (estimate, low, high) of the interval ``name`` names in ``row``: the row's own (``name``
    empty: estimate or ours, ci_low, ci_high), NAME with NAME_lo and NAME_hi (the sensitivity table), or a claim
    JSON's nested NAME.estimate, NAME.ci_low and NAME.ci_high."""
    if not name:
        found = ("estimate" if "estimate" in row else "ours", "ci_low", "ci_high")
    elif f"{name}.ci_low" in row:
        found = (f"{name}.estimate", f"{name}.ci_low", f"{name}.ci_high")
    else:
        found = (name, f"{name}_lo", f"{name}_hi")
    missing = [c for c in found if c not in row]
    if missing:
        raise DocError(f"no interval {name or 'ci'!r}: the row lacks {', '.join(missing)}")
    return found


def value(results, key):
    """The text a value span shows for ``key``, from the tables under ``results``."""
    source, fields, column, spec = parse(key)
    rows = SOURCES[source](Path(results), fields)
    rows = [r for r in rows if _matches(r, fields)]
    if source == "accuracy" and rows:  # pooled over what the key leaves open
        n = sum(int(r["n"]) for r in rows)
        rows = [{"accuracy": sum(float(r["accuracy"]) * int(r["n"]) for r in rows) / n, "n": n}]
    nested = re.fullmatch(r"(min|max)\((min|max)\((\w+)\)/(\w+)\)", column)
    if nested and rows:  # OUTER(INNER(COLUMN)/GROUP): the inner extreme within each group, the outer over groups
        groups = {}
        for r in rows:
            if str(r.get(nested[3], "")).strip():
                groups.setdefault(r.get(nested[4]), []).append(float(r[nested[3]]))
        inner = [(min if nested[2] == "min" else max)(values) for values in groups.values()]
        rows = [{column: (min if nested[1] == "min" else max)(inner)}] if inner else []
    extreme = re.fullmatch(r"(min|max)\((\w+)\)", column)
    if extreme and rows:  # the smallest or largest of a column over every matching row
        pick = min if extreme[1] == "min" else max
        column = extreme[2]
        # a row whose cell is empty (a study whose claim JSON lacks the quantity) has no value to compare
        defined = [r for r in rows if str(r.get(column, "")).strip()]
        rows = [pick(defined, key=lambda r: float(r[column]))] if defined else []
    if len(rows) != 1:
        raise DocError(f"value key {key!r}: {len(rows)} rows match, want 1")
    row = rows[0]
    if column == "ci" or column.endswith("~ci"):
        name, low, high = _interval(row, column[:-3] if column.endswith("~ci") else "")
        return f"{_number(row[name], spec)} [{_number(row[low], spec)}, {_number(row[high], spec)}]"
    width = re.fullmatch(r"width\((.*)\)", column)
    if width:  # an interval's width, ci_high - ci_low
        _, low, high = _interval(row, width[1])
        return _number(float(row[high]) - float(row[low]), spec)
    item = re.fullmatch(r"(.+)\.(\d+)", column)
    if column not in row and item and isinstance(row.get(item[1]), (list, tuple)) and int(item[2]) < len(row[item[1]]):
        row = {column: row[item[1]][int(item[2])]}  # a constant's item by position: LEVELS.1
    if column not in row:
        raise DocError(f"value key {key!r}: no column {column!r}; the row has {', '.join(row)}")
    if isinstance(row[column], (list, tuple)):  # a constant's items: NORM_WEIGHTS as 0, 0.001, ..., 1
        return ", ".join(str(item) if spec == "s" else _number(item, spec) for item in row[column])
    if spec == "s":
        return str(row[column])
    return _number(row[column], spec)


# --- rows: a table's body from a source -------------------------------------------------------------------------

INCLUDE = re.compile(r"<!-- include:(?P<file>\S+) -->\n(?P<shown>.*?)<!-- /include -->", re.S)
ROWS = re.compile(r"<!-- rows:(?P<key>[^\n]*)\n(?P<template>.*?)-->\n(?P<shown>.*?)<!-- /rows -->", re.S)


class _Cells(string.Formatter):
    """A row template's fields: a cell given a numeric format (f, g, e, %, d) is read as a number."""

    def format_field(self, cell, spec):
        if spec and spec[-1] in "fgGeE%d" and not str(cell).strip():
            return "—"  # an empty (undefined) cell
        if spec and spec[-1] in "fgGeE%d" and not isinstance(cell, (int, float)):
            cell = float(cell) if spec[-1] != "d" else int(float(cell))
        return format(cell, spec).replace("|", "\\|")  # a pipe inside a table cell is escaped


def rows(results, key, template):
    """The lines of a ``rows`` span: ``template``'s lines up to the first with a ``{COLUMN[:FORMAT]}`` field as
    they are (a table's header and separator: a comment inside a markdown table would end it), then the rest
    filled once per row of the key's source, in the source's order or sorted by ``sort=A,B`` (numbers as numbers).
    The key is ``SOURCE FIELD=VALUE ...`` as a value's, without a column; ``by=A,B`` pools source accuracy
    over everything but A, B (accuracy weighted by n, n summed), one row per combination."""
    try:
        words = shlex.split(key)
    except ValueError as err:
        raise DocError(f"rows key {key!r}: {err}") from None
    if not words or words[0] not in SOURCES or any("=" not in w for w in words[1:]):
        raise DocError(f"rows key {key!r}: want a source ({', '.join(SOURCES)}) and FIELD=VALUE words")
    fields = dict(w.split("=", 1) for w in words[1:])
    by, order = fields.pop("by", ""), fields.pop("sort", "")
    found = [r for r in SOURCES[words[0]](Path(results), fields) if _matches(r, fields)]
    if by:
        groups = {}
        for r in found:
            groups.setdefault(tuple(r[c] for c in by.split(",")), []).append(r)
        found = []
        for group, members in groups.items():
            n = sum(int(r["n"]) for r in members)
            found.append({**dict(zip(by.split(","), group)), "n": n,
                          "accuracy": sum(float(r["accuracy"]) * int(r["n"]) for r in members) / n})
    if order:
        def sort_key(row):
            return tuple((0, float(row[c]), "") if _is_number(row[c]) else (1, 0.0, str(row[c]))
                         for c in order.split(","))
        found.sort(key=sort_key)
    if not found:
        raise DocError(f"rows key {key!r}: no rows match")
    lines = template.splitlines(keepends=True)
    first = next((i for i, line in enumerate(lines) if "{" in line), len(lines))
    head, each = "".join(lines[:first]), "".join(lines[first:])
    try:
        # a column whose name a format field cannot hold (coverage_low_0.1) is also there as coverage_low_0_1
        body = "".join(_Cells().format(each, **{**{re.sub(r"\W", "_", k): v for k, v in row.items()}, **row})
                       for row in found)
    except (KeyError, ValueError) as err:
        raise DocError(f"rows key {key!r}: template field {err}") from None
    return head + re.sub(r"—(?:[–/ ]+—)+", "—", body)  # a range of two undefined cells is one dash


def _is_number(text):
    try:
        float(text)
        return True
    except (TypeError, ValueError):
        return False


# --- blocks ------------------------------------------------------------------------------------------------------


def grid(claims_csv):
    """README's results grid (markdown, ending in a newline): one row per claim, one column per study of the
    claims table (estimate [95% CI] and verdict, 4 significant digits), the paper's verdict beside them."""
    rows = _csv(Path(claims_csv))
    missing = sorted(GRID_COLUMNS - set(rows[0] if rows else ()))
    if not rows or missing:
        raise DocError(f"{claims_csv}: " + (f"missing column(s) {', '.join(missing)}" if rows else "no rows"))
    # An undefined estimate or interval (an empty class, too few items: the verdict is then inconclusive) is
    # written empty in claims.csv and shown as n/a.
    fmt = lambda text: f"{float(text):.4g}" if str(text).strip() else "n/a"  # noqa: E731
    studies = list(dict.fromkeys(r["study"] for r in rows))
    claims = sorted(dict.fromkeys(r["claim"] for r in rows), key=lambda c: int(c.lstrip("c")))
    by_key = {(r["study"], r["claim"]): r for r in rows}
    prereg = {r["study"]: r["prereg"] for r in rows}
    header = ["claim", "binding component, threshold", *(f"{s} (prereg {prereg[s]})" for s in studies), "paper"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for claim in claims:
        present = [by_key[(s, claim)] for s in studies if (s, claim) in by_key]
        papers = {r["paper_verdict"] for r in present}
        if len(papers) != 1:
            raise DocError(f"{claims_csv}: claim {claim} has paper verdicts {sorted(papers)} in different rows")
        # The component most studies decide on; a study deciding on another one names it in its own cell.
        usual = Counter((r["component"], r["threshold"]) for r in present).most_common(1)[0][0]
        cells = [f"**{claim}** {present[0]['title']}", f"`{usual[0]}`, {fmt(usual[1])}"]
        for study in studies:
            r = by_key.get((study, claim))
            if r is None:
                cells.append("—")
                continue
            own = "" if (r["component"], r["threshold"]) == usual else f"`{r['component']}`, {fmt(r['threshold'])}: "
            cells.append(f"{own}{fmt(r['estimate'])} [{fmt(r['ci_low'])}, {fmt(r['ci_high'])}]<br>**{r['verdict']}**")
        cells.append(papers.pop())
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


BY_POLICY = "by-policy-"


def by_policy(by_policy_csv, study, model="pooled"):
    """One study's per-configuration C2 and C3 (results/claims_by_policy.csv; markdown ending in a newline): a row
    per (scorer, allocator, certain-head share), C2's Poisson+Hajek minus top-k at each budget and C3's coverage
    and Spearman, each "estimate [95% CI] verdict", and the median certificate / true error."""
    rows = [r for r in _csv(Path(by_policy_csv)) if r["study"] == study and r["model"] == model]
    if not rows:
        raise DocError(f"{by_policy_csv}: no rows of study {study!r}, model {model!r}")
    fmt = lambda text, spec: format(float(text), spec).replace("-", MINUS) if str(text).strip() else "n/a"  # noqa: E731
    budgets = sorted({float(r["budget"]) for r in rows if r["claim"] == "c2" and str(r["budget"]).strip()})
    configurations = sorted({(r["policy"], r["allocator"], float(r["head_fraction"])) for r in rows})
    cell = {}
    for r in rows:
        kind = r["component"].split("[", 1)[0]
        key = (r["policy"], r["allocator"], float(r["head_fraction"]))
        slot = ("c2", float(r["budget"])) if r["claim"] == "c2" else ("c3", kind)
        spec = ".1f" if r["claim"] == "c2" else ".3f"
        cell[key, slot] = f"{fmt(r['estimate'], spec)} [{fmt(r['ci_low'], spec)}, {fmt(r['ci_high'], spec)}] {r['verdict']}"
        if r["claim"] == "c3" and str(r.get("cert_over_true_err_median", "")).strip():
            cell[key, ("ratio",)] = fmt(r["cert_over_true_err_median"], ".2f")
    header = ["scorer", "allocator", "share", *(f"C2 at {b:g} (points)" for b in budgets), "C3 coverage",
              "C3 Spearman", "certificate / true error (median)"]
    slots = [*(("c2", b) for b in budgets), ("c3", "coverage"), ("c3", "spearman"), ("ratio",)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in configurations:
        lines.append("| " + " | ".join([key[0], key[1], f"{key[2]:g}", *(cell.get((key, s), "—") for s in slots)]) + " |")
    return "\n".join(lines) + "\n"


def block(results, name):
    """The markdown of block ``name``: results-grid, or by-policy-<study>[-<model>] (``by_policy``)."""
    if name == "results-grid":
        return grid(Path(results) / "claims.csv")
    if name.startswith(BY_POLICY):
        table = Path(results) / "claims_by_policy.csv"
        study, model = name[len(BY_POLICY):], "pooled"
        models = {r["model"] for r in _csv(table)}
        for m in models:
            if study.endswith(f"-{m}"):
                study, model = study[:-len(m) - 1], m
        return by_policy(table, study, model)
    raise DocError(f"unknown block {name!r}; known: results-grid, {BY_POLICY}<study>[-<model>]")


# --- hand-written numbers ----------------------------------------------------------------------------------------

# A number as a reader meets it: digits, with thousands commas and decimals, not inside a word (v5, C3, H200).
NUMBER = re.compile(r"(?<![\w.,])[+−-]?\d[\d,]*(?:\.\d+)?(?:[eE][+−-]?\d+)?(?![\w]|\.\d)")
# What is no datum although it holds digits, each a definition rather than a measurement or a setting:
DEFINITIONS = {
    # code: a command or a literal the reader types (tests/test_docs.py checks its names against the code)
    "code": r"```.*?```|`[^`\n]*`",
    # a link's target (a file name, an anchor), and a file's path, whose digits are part of a name
    "link": r"\]\([^)]*\)|\b[\w.-]*[A-Za-z][\w.-]*(?:/[\w.-]+)+",
    # the pre-registration's version numbers and the held-out checks' names: amendment 2, amendments 2 and 3,
    # version 1, prereg 4, check 2
    "version": r"\b(?:[Aa]mendments?|[Vv]ersions?|[Cc]hecks?|prereg(?:_version)?[= ])[\s-]*\[?\d+\]?(?:(?:,\s+|\s+and\s+|\s+or\s+|\s+to\s+|[–-])\[?\d+\]?)*",
    # a name holding digits: model families and versions, the paper's arXiv id, the lock's Python
    "name": r"Gemma 3|Llama[ -]3\.1|Phi-3|arXiv[ :]\d{4}\.\d{4,5}|Python 3\.\d+",
    # a level written in δ, the formula being its definition: (1 − δ), 1 − δ/5
    "level": r"\b1 ?[−-] ?δ(?:/\d+)?",
    # a day written as an ISO date (a record's or an amendment's date names it, as a version does)
    "date": r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b",
    # the year of a citation: (P. Xie, 2026), Feng et al. 2024
    "year": r"(?<=, )(?:19|20)\d\d(?=\))|(?<=et al\. )(?:19|20)\d\d\b",
    # 0 and 1 as a formula's bounds and identities: π = 1, (0, 1], 1 − π, 0 < π < 1
    "math": r"(?<=[=<>≤≥∈(\[−+] )[01](?![\d.,]\d)|(?<=[=<>≤≥∈(\[])[01](?![\d.,]\d)|\b[01](?= ?[<≤−+·/\])]| ?[,;] ?[01π]\b)",
    # a command's exit status (0 success, 1 failure, 2 bad input: the tools' convention, tested by their CLI tests)
    "exit": r"(?<=\bexit )[012]\b|(?<=\bexits )[012]\b|(?<=\bexit status )[012]\b",
    # a step of a numbered list or a numbered heading, a reference to one (step 4, steps 2-4), and a section
    # sign's number (METHOD.md §7)
    "step": r"^[ \t]*(?:#+ )?\d+\.(?= )|\b[Ss]teps? \d+(?:[-–]\d+)?\b|§\d+(?:\.\d+)*",
}
# code and link targets first: a version's pattern must not take a link's bracket
UNCOUNTED = [re.compile(f"{DEFINITIONS['code']}|{DEFINITIONS['link']}", re.S),
             re.compile("|".join(f"(?:{p})" for k, p in DEFINITIONS.items() if k not in ("code", "link")), re.M)]


def hand_written(page_text):
    """The numbers a page states by hand: every number outside its rendered spans and generated blocks and outside
    DEFINITIONS, as (line number, the number, its context) in page order."""
    blanked = BLOCK.sub(lambda m: _blank(m[0]), page_text)
    blanked = VALUE.sub(lambda m: _blank(m[0]), blanked)
    # a rows span's output is rendered; its template's own text (a header, words around the fields) is not
    blanked = INCLUDE.sub(lambda m: _blank(m[0]), blanked)
    blanked = ROWS.sub(lambda m: _blank(m[0][:m.start("template") - m.start()])
                       + re.sub(r"\{[^{}\n]*\}", lambda f: _blank(f[0]), m["template"])
                       + _blank(m[0][m.end("template") - m.start():]), blanked)
    for pattern in UNCOUNTED:
        blanked = pattern.sub(lambda m: _blank(m[0]), blanked)
    found = []
    for match in NUMBER.finditer(blanked):
        line = blanked.count("\n", 0, match.start()) + 1
        context = " ".join(page_text[max(0, match.start() - 40):match.end() + 20].split())
        found.append((line, match[0], context))
    return found


def _blank(text):
    """``text`` as spaces, its line breaks kept (so that line numbers and lookarounds stay)."""
    return re.sub(r"[^\n]", " ", text)


# --- pages -------------------------------------------------------------------------------------------------------


def render(page_text, results, where="page"):
    """``page_text`` with every value span and block rendered from the tables under ``results``."""
    def one_value(match):
        try:
            shown = value(results, match["key"])
        except DocError as err:
            raise DocError(f"{where}: {err}") from None
        return f"<!-- value:{match['key']} -->{shown}<!-- /value -->"

    def one_block(match):
        try:
            shown = block(results, match["name"])
        except DocError as err:
            raise DocError(f"{where}: {err}") from None
        return f"{match['open']}{shown}{match['close']}"
    def one_rows(match):
        try:
            shown = rows(results, match["key"], match["template"])
        except DocError as err:
            raise DocError(f"{where}: {err}") from None
        return f"<!-- rows:{match['key']}\n{match['template']}-->\n{shown}<!-- /rows -->"
    def one_include(match):
        path = Path(results) / match["file"]
        if not path.is_file():
            raise DocError(f"{where}: include: no such file {match['file']!r} (relative to the results folder)")
        shown = path.read_text(encoding="utf-8")
        return f"<!-- include:{match['file']} -->\n{shown}{'' if shown.endswith(chr(10)) else chr(10)}<!-- /include -->"
    opened = len(re.findall(r"<!-- value:", page_text))
    if opened != len(VALUE.findall(page_text)):
        raise DocError(f"{where}: a <!-- value:... --> span lacks its <!-- /value -->")
    if len(re.findall(r"<!-- rows:", page_text)) != len(ROWS.findall(page_text)):
        raise DocError(f"{where}: a <!-- rows:... --> span lacks its <!-- /rows -->")
    if len(re.findall(r"<!-- include:", page_text)) != len(INCLUDE.findall(page_text)):
        raise DocError(f"{where}: a <!-- include:FILE --> span lacks its <!-- /include -->")
    return INCLUDE.sub(one_include, ROWS.sub(one_rows, BLOCK.sub(one_block, VALUE.sub(one_value, page_text))))


def inputs(pages, results):
    """Every file the pages' values and blocks read."""
    files = {Path(results) / "claims.csv"}
    for page in pages:
        text = Path(page).read_text(encoding="utf-8")
        for match in VALUE.finditer(text):
            files.update(source_files(results, match["key"]))
        files.update(Path(results) / m["file"] for m in INCLUDE.finditer(text))
        for match in ROWS.finditer(text):
            words = shlex.split(match["key"])
            files.update(_files(Path(results), words[0], dict(w.split("=", 1) for w in words[1:])))
        if any(m["name"].startswith(BY_POLICY) for m in BLOCK.finditer(text)):
            files.add(Path(results) / "claims_by_policy.csv")
    return sorted(str(f) for f in files)


def write(results, pages, grid_out):
    for page in map(Path, pages):
        before = page.read_text(encoding="utf-8")
        after = render(before, results, where=str(page))
        if after != before:  # an unchanged page keeps its timestamp
            write_text_atomic(after, page)
    write_text_atomic(grid(Path(results) / "claims.csv"), grid_out)  # last: the rule's output is the newest file


def count(pages, verbose=False):
    """Print each page's count of hand-written numbers (and, verbose, each of them) and the total."""
    total = 0
    for page in pages:
        found = hand_written(Path(page).read_text(encoding="utf-8"))
        total += len(found)
        print(f"{len(found):6d}  {page}")
        for line, number, context in found if verbose else ():
            print(f"        {page}:{line}: {number}  ({context})")
    print(f"{total:6d}  total")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="the folder of the tables (results)")
    parser.add_argument("pages", nargs="*", help="markdown pages whose values and blocks are rendered in place")
    parser.add_argument("--grid", help="the results grid as a markdown file (required unless --count)")
    parser.add_argument("--count", action="store_true",
                        help="write nothing: print each page's hand-written numbers (outside spans and DEFINITIONS)")
    parser.add_argument("--verbose", "-v", action="store_true", help="with --count: each number, its line and context")
    args = parser.parse_intermixed_args(argv)  # the docstring's order: pages after --grid
    if args.count:
        return count(args.pages, args.verbose)
    if not args.grid:
        parser.error("--grid is required unless --count")
    try:
        write(args.results, args.pages, args.grid)
    except (OSError, ValueError) as err:
        print(f"render_docs: error: {err}", file=sys.stderr)
        return 1
    return 0


if "snakemake" in globals():
    write(snakemake.params.results, snakemake.params.pages, snakemake.output.grid)  # noqa: F821
elif __name__ == "__main__":
    sys.exit(main())

"""Scale files: which cells a pipeline scale runs, and scales derived from others by substitution.

A scale file (``configs/scales/<name>.yaml``, the folder ``scales_folder(root)`` names) either lists its
``cells`` directly, or a ``matrix`` (models × data × settings, each cell split into ``shards``) whose cells
share one ``grid`` of configurations. ``models`` maps a model key to its ``kvcert-run`` model overrides.

A study is one pre-registration version applied to cells. A scale lists its studies under ``studies:``
(each with ``prereg:`` and ``cells:``/``matrix:``, ``cells_from: <study>`` to analyse another study's cells,
or ``archived: true`` for a study whose committed results are read as they are), or is one study, named
``v<prereg>``, made of its top-level ``cells``/``matrix``. ``exploratory:`` studies list a ``base`` of
overrides and ``variants`` (one cell each); no pre-registered claim reads them.

A study that applies a locked design references it instead of copying its cells: ``design: {file: <path
relative to the scale file>, study: <dotted key of the design's study>}``, e.g. ``{file:
../../preregistration/amendment-4/design.yaml, study: powered.study}``. The design's study (its ``prereg`` and
``cells``) becomes the study's; the scale adds nothing to it, so the scale runs exactly what was locked.

A study whose locked design gives item counts but no cells (amendments 2 and 3) builds them from a cell
``template``: ``{prereg, template: <path>, counts: {file, key}, shards: {cell: n}, fill: {name: [overrides]}}``.
The template file lists ``models`` (each with its own ``fill``) and ``kinds`` (each an override list and the
``count`` key it is sized by); the study runs one cell per model and kind, named ``<kind>-<model>``, model by
model. An override that is exactly ``{name}`` is replaced by the model's, else the study's, ``fill`` list of that
name (which may be empty); ``{items}`` in an override is the cell's count: the design's entry for the cell's name,
else its entry for the model and the kind's ``count`` key. So the overrides several cells share are written once,
in the template, and the counts are read from the locked file, not copied.

A derived scale names a ``base`` scale and lists only ``substitute``: dotted paths into the base and
what replaces them. A substitute that is a mapping applied to a list of ``key=value`` overrides
replaces those keys in the list (appending the keys the list lacks); any other substitute replaces the
value at its path. Every path must exist in the base, so a derived scale can swap sizes and sources
but cannot add cells, configurations or claims: whatever the base's matrix, grid and claims become,
the derived scale follows.

A cell is a typed mapping (``Cell``): its model key, its shards and its ``kvcert-run`` overrides. The
overrides stay ``key=value`` strings in the file (the committed records were run from them); they are read
with Hydra's override grammar (``parse_overrides``), their keys checked against the run configuration's
schema (kvcert.run_schema.RunConfig) when a scale is expanded, and ``cell_config`` composes a cell's typed
configuration exactly as ``kvcert-run`` will.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import Any, Mapping, NotRequired, TypedDict

import yaml

from .run_schema import DesignOptions, RunConfig


class ScaleError(ValueError):
    """A scale file that cannot be read or derived; the message names the file and the key."""


class Cell(TypedDict):
    """One cell of a scale: a key of the scale's ``models``, its shards, its ``kvcert-run`` overrides, and, where a
    design names it, its ``kind`` (the cell type its item count was sized for: qa, oracle or streaming)."""

    model: str
    shards: int
    overrides: list[str]
    kind: NotRequired[str]


CELL_KINDS = ("qa", "oracle", "streaming")


# Keys an override may set: the schema's, design_options' own, and anything below the config groups and
# policy_options (their loaders check those).
_RUN_KEYS = {f.name for f in dataclasses.fields(RunConfig)} - {"defaults"}
_DOTTED_KEYS = {f"design_options.{f.name}" for f in dataclasses.fields(DesignOptions)}
_OPEN_PREFIXES = ("data.", "model.", "policy_options.")


# Where a repository keeps its scale files: beside the run configs (configs/run), in the one folder of the
# pipeline's configuration. Every tool finds them through scales_folder(root), so a scale file dropped there is known.
SCALES_FOLDER = Path("configs") / "scales"


def scales_folder(root: str | Path = ".") -> Path:
    """The folder of scale files of the repository at ``root`` (``configs/scales``)."""
    return Path(root) / SCALES_FOLDER


def scale_names(scales_dir: str | Path) -> list[str]:
    return sorted(p.stem for p in Path(scales_dir).glob("*.yaml"))


def load_scale(name: str, scales_dir: str | Path) -> dict[str, Any]:
    """The scale ``name`` from ``scales_dir``, with its base applied if it is derived.

    Returns the scale mapping plus ``name`` and ``claims_scale`` (the scale whose pre-registered
    claim populations apply: the root of the ``base`` chain).
    """
    scales_dir = Path(scales_dir)
    seen: list[str] = []
    return _load(name, scales_dir, seen)


def _load(name: str, scales_dir: Path, seen: list[str]) -> dict[str, Any]:
    path = scales_dir / f"{name}.yaml"
    if not path.is_file():
        raise ScaleError(f"scale={name}: unknown scale; known: {', '.join(scale_names(scales_dir))}")
    if name in seen:
        raise ScaleError(f"{path.name}: base chain loops ({' -> '.join([*seen, name])})")
    seen.append(name)
    raw = _parse_yaml(path, str(path)) or {}
    if not isinstance(raw, dict):
        raise ScaleError(f"{path}: expected a mapping of scale keys")
    if "base" not in raw:
        if "substitute" in raw:
            raise ScaleError(f"{path.name}: 'substitute' needs a 'base' scale to substitute into")
        return {**_with_designs(raw, path), "name": name, "claims_scale": name}
    unknown = sorted(set(raw) - {"base", "substitute", "purpose"})
    if unknown:
        raise ScaleError(f"{path.name}: {unknown[0]}: a derived scale lists only base, purpose and substitute")
    base = _load(str(raw["base"]), scales_dir, seen)
    derived = derive(base, raw.get("substitute") or {}, where=path.name)
    derived.update(name=name, base=str(raw["base"]), claims_scale=base["claims_scale"])
    if raw.get("purpose"):
        derived["purpose"] = raw["purpose"]
    return derived


DESIGN_KEYS = ("file", "study")


def _with_designs(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """``raw`` with every study that references a locked design (``design:``) replaced by that design's study. A
    study whose amendment is not locked yet names the file that must exist first (``pending: {until: <path relative
    to the scale file, e.g. the amendment's lock>, why: <text>}``); until it exists the study is left out and listed
    under the scale's ``pending`` ({study: why}), so that no cell of it runs before its lock."""
    if not isinstance(raw.get("studies"), dict):
        return raw
    out = dict(raw)
    waiting = {name: _pending(name, spec["pending"], path) for name, spec in raw["studies"].items()
               if isinstance(spec, dict) and "pending" in spec}
    waiting = {name: why for name, why in waiting.items() if why is not None}
    out["studies"] = {name: _design_study(name, spec, path) if isinstance(spec, dict) and "design" in spec
                      else _templated_study(name, spec, path) if isinstance(spec, dict) and "template" in spec
                      else spec
                      for name, spec in raw["studies"].items() if name not in waiting}
    if waiting:
        out["pending"] = waiting
    return out


def _pending(name: str, pending: Any, path: Path) -> str | None:
    """Why study ``name`` of the scale file ``path`` is pending, or None once ``pending.until`` exists."""
    if not isinstance(pending, dict) or sorted(pending) != ["until", "why"]:
        raise ScaleError(f"{path.name}: study {name}: pending={pending!r}: expected a mapping of until and why")
    return None if (path.parent / str(pending["until"])).is_file() else str(pending["why"])


def _parse_yaml(path: Path, label: str) -> Any:
    """The parsed YAML file ``path``; a syntax error is a one-line ScaleError that starts with ``label``."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ScaleError(f"{label}: not valid YAML ({' '.join(str(err).split())})") from None


def _read_yaml(where: str, base: Path, relative: Any) -> Any:
    """The YAML file at ``relative`` (to the directory ``base``), or a ScaleError naming ``where``."""
    found = (base / str(relative)).resolve()
    if not found.is_file():
        raise ScaleError(f"{where}={relative}: no such file (paths are relative to the scale file)")
    return _parse_yaml(found, f"{where}={relative}")


def _dotted(found: Any, key: str, where: str, file: str) -> Any:
    """The value at the dotted ``key`` of the parsed ``file``, or a ScaleError naming ``where`` and the missing part."""
    for depth, part in enumerate(key.split(".")):
        if not isinstance(found, dict) or part not in found:
            raise ScaleError(f"{where}={key}: {'.'.join(key.split('.')[: depth + 1])} is not in {file}")
        found = found[part]
    return found


TEMPLATE_KEYS = ("prereg", "template", "counts", "shards", "fill")


def _templated_study(name: str, spec: dict[str, Any], path: Path) -> dict[str, Any]:
    """The study ``name`` of the scale file ``path`` built from its cell template and its design's counts."""
    where = f"{path.name}: study {name}"
    unknown = sorted(set(spec) - set(TEMPLATE_KEYS))
    missing = [key for key in TEMPLATE_KEYS[:4] if key not in spec]
    if unknown or missing:
        raise ScaleError(f"{where}: {(unknown or missing)[0]}: a templated study takes "
                         f"{', '.join(TEMPLATE_KEYS[:4])} and optionally fill")
    template = _read_yaml(f"{where}: template", path.parent, spec["template"])
    if not isinstance(template, dict) or not isinstance(template.get("models"), dict) \
            or not isinstance(template.get("kinds"), dict):
        raise ScaleError(f"{where}: template={spec['template']}: expected a mapping with models and kinds")
    ref = spec["counts"]
    if not isinstance(ref, dict) or sorted(ref) != ["file", "key"]:
        raise ScaleError(f"{where}: counts={ref!r}: expected a mapping of file and key")
    counts = _dotted(_read_yaml(f"{where}: counts.file", path.parent, ref["file"]), str(ref["key"]),
                     f"{where}: counts.key", str(ref["file"]))
    fill = spec.get("fill") or {}
    cells = {}
    for model, model_spec in template["models"].items():
        model_fill = (model_spec or {}).get("fill") or {}
        for kind, kind_spec in template["kinds"].items():
            cell = f"{kind}-{model}"
            at = f"{where}: cell {cell}"
            if cell in counts:
                items = counts[cell]
            elif isinstance(counts.get(model), dict) and kind_spec.get("count") in counts[model]:
                items = counts[model][kind_spec["count"]]
            else:
                raise ScaleError(f"{at}: {ref['file']} {ref['key']} has no count for {cell} nor for "
                                 f"{model}.{kind_spec.get('count')}")
            if cell not in (spec["shards"] or {}):
                raise ScaleError(f"{at}: shards.{cell} is missing")
            overrides = []
            for override in kind_spec.get("overrides") or []:
                text = str(override)
                if text.startswith("{") and text.endswith("}") and "=" not in text:
                    placeholder = text[1:-1]
                    if placeholder in model_fill:
                        overrides += [str(o) for o in model_fill[placeholder] or []]
                    elif placeholder in fill:
                        overrides += [str(o) for o in fill[placeholder] or []]
                    else:
                        raise ScaleError(f"{at}: override {text}: no fill named {placeholder} (the model's in "
                                         f"{spec['template']}, or the study's)")
                else:
                    overrides.append(text.replace("{items}", str(items)))
            cells[cell] = {"model": model, "shards": spec["shards"][cell], "overrides": overrides}
    extra = sorted(set(spec["shards"]) - set(cells))
    if extra:
        raise ScaleError(f"{where}: shards.{extra[0]}: not a cell of the template ({', '.join(cells)})")
    return {"prereg": spec["prereg"], "cells": cells}


def _design_study(name: str, spec: dict[str, Any], path: Path) -> dict[str, Any]:
    """The study ``name`` of the scale file ``path`` as its referenced design defines it (prereg and cells)."""
    where = f"{path.name}: study {name}: design"
    ref = spec["design"]
    if not isinstance(ref, dict) or sorted(ref) != sorted(DESIGN_KEYS):
        raise ScaleError(f"{where}={ref!r}: expected a mapping of {' and '.join(DESIGN_KEYS)}")
    extra = sorted(set(spec) - {"design", "pending"})
    if extra:
        raise ScaleError(f"{where}: {extra[0]}: a study that applies a design takes its prereg and cells from it")
    found = _dotted(_read_yaml(f"{where}.file", path.parent, ref["file"]), str(ref["study"]), f"{where}.study",
                    str(ref["file"]))
    if not isinstance(found, dict) or "prereg" not in found or "cells" not in found:
        raise ScaleError(f"{where}.study={ref['study']}: expected a study (prereg and cells) in {ref['file']}")
    return copy.deepcopy({"prereg": found["prereg"], "cells": found["cells"]})


def _is_override_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value)


def substitute_overrides(overrides: list[str], replacements: Mapping[str, Any]) -> list[str]:
    """``overrides`` (``key=value`` strings) with each key of ``replacements`` set to its value.

    Keys already present keep their place; missing keys are appended in the order given.
    """
    out = list(overrides)
    for key, value in replacements.items():
        text = f"{key}={_override_value(value)}"
        at = [i for i, o in enumerate(out) if o.split("=", 1)[0].lstrip("+") == key]
        if at:
            out[at[0]] = text
        else:
            out.append(text)
    return out


def _override_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return "null" if value is None else str(value)


def derive(base: Mapping[str, Any], substitute: Mapping[str, Any], where: str = "scale") -> dict[str, Any]:
    """A deep copy of ``base`` with every ``substitute`` path replaced (see the module docstring)."""
    if not isinstance(substitute, Mapping):
        raise ScaleError(f"{where}: substitute must be a mapping of dotted paths")
    out = copy.deepcopy(dict(base))
    for path, value in substitute.items():
        parts = str(path).split(".")
        parent = out
        for depth, part in enumerate(parts[:-1]):
            if not isinstance(parent, dict) or part not in parent:
                raise ScaleError(f"{where}: substitute.{path}: {'.'.join(parts[: depth + 1])} is not in the base scale")
            parent = parent[part]
        leaf = parts[-1]
        if not isinstance(parent, dict) or leaf not in parent:
            raise ScaleError(f"{where}: substitute.{path}: not in the base scale (a derived scale only substitutes)")
        current = parent[leaf]
        if _is_override_list(current) and isinstance(value, Mapping):
            parent[leaf] = substitute_overrides(current, value)
        elif isinstance(current, dict) and not isinstance(value, Mapping):
            raise ScaleError(f"{where}: substitute.{path}: the base has a mapping here; substitute its keys")
        else:
            parent[leaf] = copy.deepcopy(value)
    return out


def expand_cells(scale: Mapping[str, Any]) -> dict[str, Cell]:
    """Cell name -> ``Cell``: the scale's listed cells plus its matrix, each checked (``checked_cell``).

    Matrix cells are named ``<model>-<data>-<setting>`` and run the data's overrides, then the grid,
    then the setting. A matrix's optional ``variants`` (``{name: {settings: [...], overrides: [...]}}``) add,
    for each model and data, a cell ``<model>-<data>-<setting>-<name>`` per setting the variant names, running
    the base cell's overrides then the variant's (so a variant can change what the grid cannot vary: design
    options, the designs a defense allows).
    """
    cells = {name: dict(spec) if isinstance(spec, Mapping) else spec for name, spec in (scale.get("cells") or {}).items()}
    matrix = scale.get("matrix")
    if matrix:
        variants = _matrix_variants(scale, matrix)
        for model in matrix["models"]:
            for data_name, data_overrides in matrix["data"].items():
                for setting in matrix["settings"]:
                    base = list(data_overrides) + list(scale["grid"]) + [f"setting={setting}"]
                    cells[f"{model}-{data_name}-{setting}"] = {"model": model, "shards": matrix["shards"], "overrides": base}
                    for variant, spec in variants.items():
                        if setting in spec["settings"]:
                            cells[f"{model}-{data_name}-{setting}-{variant}"] = {
                                "model": model, "shards": matrix["shards"], "overrides": base + list(spec["overrides"])}
    return {name: checked_cell(scale, name, spec) for name, spec in cells.items()}


def _matrix_variants(scale: Mapping[str, Any], matrix: Mapping[str, Any]) -> dict[str, dict]:
    """A matrix's ``variants``, checked: each a mapping of ``settings`` (a subset of the matrix's) and
    ``overrides`` (key=value strings)."""
    variants = matrix.get("variants") or {}
    where = f"scale={scale.get('name', '?')}: matrix.variants"
    if not isinstance(variants, Mapping):
        raise ScaleError(f"{where}: expected a mapping of variant name to {{settings, overrides}}")
    for name, spec in variants.items():
        if not isinstance(spec, Mapping) or sorted(spec) != ["overrides", "settings"]:
            raise ScaleError(f"{where}.{name}: expected a mapping of settings and overrides")
        unknown = [s for s in spec["settings"] or [] if s not in matrix["settings"]]
        if not spec["settings"] or unknown:
            raise ScaleError(f"{where}.{name}: settings={spec['settings']!r}: expected a non-empty subset of the "
                             f"matrix's settings ({', '.join(matrix['settings'])})")
        if not isinstance(spec["overrides"], list) or not all(isinstance(o, str) for o in spec["overrides"]):
            raise ScaleError(f"{where}.{name}: overrides={spec['overrides']!r}: expected a list of key=value strings")
    return dict(variants)


def checked_cell(scale: Mapping[str, Any], name: str, spec: Any) -> Cell:
    """``spec`` as a ``Cell``, or a ScaleError naming the scale, the cell and the field or override at fault."""
    where = f"scale={scale.get('name', '?')}: cell {name}"
    if not isinstance(spec, Mapping):
        raise ScaleError(f"{where}: expected a mapping of {', '.join(Cell.__annotations__)}")
    unknown = sorted(set(spec) - set(Cell.__annotations__))
    if unknown:
        raise ScaleError(f"{where}: {unknown[0]}: unknown field; known: {', '.join(Cell.__annotations__)}")
    if spec.get("model") not in (scale.get("models") or {}):
        raise ScaleError(f"{where}: model {spec.get('model')!r} is not in models ({', '.join(scale.get('models') or {})})")
    shards = spec.get("shards", 1)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ScaleError(f"{where}: shards={shards!r}: expected an integer >= 1")
    overrides = spec.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ScaleError(f"{where}: overrides={overrides!r}: expected a list of key=value strings")
    for key in parse_overrides(overrides, where):
        if key not in _RUN_KEYS and key not in _DOTTED_KEYS and not key.startswith(_OPEN_PREFIXES):
            raise ScaleError(f"{where}: override {key}=...: {key} is not a kvcert-run key")
    cell = Cell(model=str(spec["model"]), shards=shards, overrides=list(overrides))
    if "kind" in spec:
        if spec["kind"] not in CELL_KINDS:
            raise ScaleError(f"{where}: kind={spec['kind']!r}: expected one of {', '.join(CELL_KINDS)}")
        cell["kind"] = spec["kind"]
    return cell


def studies(scale: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{study: {"prereg": version, "cells": {cell: spec}, "source": study whose cells it reads, "archived"}}."""
    where = f"{scale.get('name', 'scale')}.yaml"
    if "studies" not in scale:
        if not scale.get("cells") and not scale.get("matrix"):
            return {}  # an exploratory-only scale
        version = int(scale.get("prereg", 1))
        return {f"v{version}": {"prereg": version, "cells": expand_cells(scale), "source": f"v{version}",
                                "archived": False}}
    out = {}
    for name, spec in scale["studies"].items():
        source = spec.get("cells_from", name)
        if source not in scale["studies"]:
            raise ScaleError(f"{where}: study {name}: cells_from={source} is not a study of this scale")
        if "prereg" not in spec:
            raise ScaleError(f"{where}: study {name}: prereg (the pre-registration version) is missing")
        archived = bool(spec.get("archived", False))
        own = {k: v for k, v in scale.items() if k not in ("studies", "cells", "matrix")}
        cells = {} if archived else expand_cells({**own, **scale["studies"][source]})
        out[name] = {"prereg": int(spec["prereg"]), "cells": cells, "source": source, "archived": archived}
    return out


def current_study(scales_dir: str | Path, scale: str = "default") -> str:
    """The study a scale computes rather than reads as a record: its one study that is not archived (for the
    default scale, the newest amendment's, what `make reproduce` runs). Tests and tools name the current study
    through this, so that a new amendment moves it by editing the scale file alone."""
    computed = [name for name, spec in studies(load_scale(scale, scales_dir)).items() if not spec["archived"]]
    if len(computed) != 1:
        raise ScaleError(f"{scale}.yaml: expected one study that is not archived (the current one); found "
                         f"{', '.join(computed) or 'none'}")
    return computed[0]


def design_reference(scales_dir: str | Path, scale: str, study: str) -> tuple[Path, str]:
    """(design file, dotted key of its study) that ``study`` of ``scale`` applies (``design: {file, study}``); the
    file resolved against the scale file's folder. A study that references no design is a one-line ScaleError."""
    path = Path(scales_dir) / f"{scale}.yaml"
    raw = _parse_yaml(path, str(path)) or {}
    spec = (raw.get("studies") or {}).get(study) if isinstance(raw, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("design"), dict):
        raise ScaleError(f"{path.name}: study {study}: references no design (design: {{file, study}})")
    return (path.parent / spec["design"]["file"]).resolve(), str(spec["design"]["study"])


# What reads an exploratory study's cells (a rule of workflow/rules/exploratory.smk each): the one-knob-at-a-time
# sensitivity table unless the study names another.
EXPLORATORY_ANALYSES = ("sensitivity", "certified_budgets", "accuracy")


def exploratory(scale: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{study: {"cells": {cell: Cell}, "variant": {cell: variant}, "analysis": name}} of the scale's exploratory
    studies.

    A study on one ``model`` runs one cell per variant, named as the variant. A study on several ``models``
    (a mapping of model key to the overrides that model's cells add after the base, e.g. its workload and
    SnapKV knobs) runs one cell per model and variant, named ``<model>-<variant>``; the variant's overrides
    come last. ``analysis`` (EXPLORATORY_ANALYSES; default ``sensitivity``) names the rule that reads them.
    """
    out = {}
    for name, spec in (scale.get("exploratory") or {}).items():
        where = f"scale={scale.get('name', '?')}: exploratory study {name}"
        analysis = spec.get("analysis", "sensitivity")
        if analysis not in EXPLORATORY_ANALYSES:
            raise ScaleError(f"{where}: analysis={analysis!r}: unknown; known: {', '.join(EXPLORATORY_ANALYSES)}")
        if ("model" in spec) == ("models" in spec):
            raise ScaleError(f"{where}: give either model (one model) or models (model key -> overrides)")
        per_model = spec["models"] if "models" in spec else {spec["model"]: []}
        if not isinstance(per_model, Mapping):
            raise ScaleError(f"{where}: models={per_model!r}: expected a mapping of model key to overrides")
        cells, variant_of = {}, {}
        for model, model_overrides in per_model.items():
            for variant, extra in spec["variants"].items():
                cell = variant if "model" in spec else f"{model}-{variant}"
                cells[cell] = checked_cell(scale, f"{name}/{cell}", {
                    "model": model, "shards": spec.get("shards", 1),
                    "overrides": [*spec["base"], *(model_overrides or []), *extra]})
                variant_of[cell] = variant
        out[name] = {"cells": cells, "variant": variant_of, "analysis": analysis}
    return out


def study_cells(scale: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(study, cell) -> spec for every cell the scale runs: each computed study's own cells (a study that
    reads another's runs none) and the exploratory studies' cells."""
    found = studies(scale)
    owners = sorted({st["source"] for st in found.values() if not st["archived"]})
    out = {(study, cell): spec for study in owners for cell, spec in found[study]["cells"].items()}
    for study, spec in exploratory(scale).items():
        out.update({(study, cell): cell_spec for cell, cell_spec in spec["cells"].items()})
    return out


def shard_list(cells: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, int]]:
    """(cell, shard) for every job of the ``cell`` rule, in a stable order."""
    return [(cell, shard) for cell, spec in cells.items() for shard in range(int(spec["shards"]))]


def cell_overrides(scale: Mapping[str, Any], cell: Mapping[str, Any]) -> list[str]:
    """The ``kvcert-run`` overrides of a cell: its model's, then its own (a later key wins)."""
    return list(scale["models"][cell["model"]]) + list(cell["overrides"])


def parse_overrides(overrides: list[str], where: str = "overrides") -> dict[str, Any]:
    """``key=value`` overrides read with Hydra's override grammar, as kvcert-run reads them: {key: value} with
    typed values (``n_items=30`` -> 30, ``'data.subsets=[a,b]'`` -> ['a', 'b'], ``null`` -> None); the last
    override of a key wins, ``+`` (append) is dropped. A group choice (``data=ruler``) is the option's name."""
    from hydra.errors import OverrideParseException

    try:
        parsed = _parser().parse_overrides(list(overrides))
    except OverrideParseException as err:
        raise ScaleError(f"{where}: {' '.join(str(err).split())}") from None
    return {override.key_or_group: override.value() for override in parsed}


@functools.lru_cache(maxsize=1)
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def override_value(overrides: list[str], key: str) -> Any:
    """The value a list of ``key=value`` overrides gives ``key`` (``parse_overrides``; the last one wins), or None."""
    return parse_overrides(overrides).get(key)


def cell_config(scale: Mapping[str, Any], cell: Cell, extra: list[str] = ()):
    """The cell's kvcert-run configuration, composed and typed as the runner composes it (a DictConfig of
    kvcert.run_schema.RunConfig); ``extra`` overrides come last."""
    from .hydra_app import compose

    return compose([*cell_overrides(scale, cell), *extra])


def needs_longbench_copy(scale: Mapping[str, Any], cell: Mapping[str, Any]) -> bool:
    """Whether a cell reads LongBench from the hub (no data.path), so that it needs the fetched copy."""
    overrides = cell_overrides(scale, cell)
    values = parse_overrides(overrides)
    return values.get("data") == "longbench" and values.get("data.path") is None


def longbench_subsets(scale: Mapping[str, Any], cells: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every LongBench subset the hub-reading cells of a scale use (the loader's defaults where unset)."""
    from .data.longbench import DEFAULTS

    subsets: list[str] = []
    for cell in cells.values():
        if needs_longbench_copy(scale, cell):
            listed = override_value(cell_overrides(scale, cell), "data.subsets")
            for subset in listed or DEFAULTS["subsets"]:
                if subset not in subsets:
                    subsets.append(subset)
    return subsets

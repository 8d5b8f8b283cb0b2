"""The run config's walk through the library: how many modules ("rooms") it passes and how often it climbs back.

Follows one cell's run config from ``kvcert.runner.cell.run_cell`` down through the library, as issue 40 first
counted it ("followed from run_cell, cfg passes through 13 modules and climbs back to a higher layer 12 times"):

* A **unit** is a module of ``kvcert`` or one of its sub-packages taken whole, each with its **layer** as the
  library declares them (``LAYERS`` in tests/test_module_graph.py, which checks that a unit imports only lower
  layers): ``kvcert.runner`` 8, ``kvcert.generation`` 6, ``kvcert.sampling`` 1 ...
* The run config is every value of its types (the raw Hydra config, ``RunConfig``/``CellConfig``,
  ``DesignOptions``, ``Grid``, ``Configuration``, ``Target``) and the mappings and sequences the checked config
  holds (data, model, policy options, the resolved config); with ``--values``, also every float and string read
  from it at any depth (followed by identity; ints, bools and None are shared objects that identity cannot
  follow). A call **carries the config** when one of its arguments is such a value (``self`` and ``**kwargs``
  included).
* The **walk** moves from the caller's unit (the nearest library frame above the call) to the callee's unit on each
  call that carries the config, and back on its return. **Rooms**: the units the walk enters (``kvcert.runner``
  included). **Climbs**: the distinct moves of the walk from a unit to one of a higher layer; a call down to a
  lower layer climbs back when it returns, and a call up (a callback, a method of a higher unit's object) climbs
  on the call. A tree of calls over n rooms climbs n - 1 times; every extra climb is a unit reached two ways,
  such as a bounce between two modules.

The cell traced is certified-budgets' ``target_0.1`` cell on SmolLM2 (``configs/scales/certified-budgets.yaml``:
its base, the model's overrides and the variant's), cut to one item: the walk does not
depend on how many items or steps repeat it. ``--overrides`` replaces the cell.

    python benchmarks/config_walk.py [--json] [--overrides data=ruler ...]

Prints the units with their layers, the walk's distinct moves (caller -> callee, first call seen) and the two
counts. Tracing runs every Python call of the cell through a profile hook: about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvcert"
SCALE = ROOT / "configs" / "scales" / "certified-budgets.yaml"


def package_dir() -> Path:
    """The imported kvcert's folder (the checkout's src/kvcert in an editable install)."""
    import kvcert

    return Path(kvcert.__file__).resolve().parent


def declared_layers(package: Path) -> dict[str, int]:
    """The library's declared layers (``LAYERS`` of the checkout's tests/test_module_graph.py, which checks that
    no unit imports its own layer or one above): unit -> layer, a unit being ``kvcert.x`` (a module or a
    sub-package taken whole)."""
    import importlib.util

    source = package.parents[1] / "tests" / "test_module_graph.py"
    spec = importlib.util.spec_from_file_location("kvcert_module_graph", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.LAYERS)


def unit_of_file(path: str, package: Path, layer: dict[str, int]) -> str | None:
    """The unit of a source file of the package (its longest dotted prefix that has a layer); None outside it."""
    try:
        relative = Path(path).resolve().relative_to(package)
    except ValueError:
        return None
    parts = [PACKAGE, *relative.with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in layer), None)


def config_types() -> tuple[type, ...]:
    """The types whose values are the run config or one of its parts (those this checkout defines)."""
    import importlib

    names = [("omegaconf", "DictConfig"), ("omegaconf", "ListConfig"), ("kvcert.run_schema", "RunConfig"),
             ("kvcert.run_schema", "DesignOptions"), ("kvcert.run_schema", "GridKnobs"),
             ("kvcert.runner.config", "Grid"), ("kvcert.generation", "Configuration"), ("kvcert.targets", "Target"),
             # their names before 2026-12-03 (aa27907, 4ebb2da), so that an older checkout is measured alike
             ("kvcert.defaults", "RunConfig"), ("kvcert.defaults", "DesignOptions"), ("kvcert.generation", "DesignKnobs")]
    found = []
    for module, name in names:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # an older checkout without it
            pass
    return tuple(found)


class Walk:
    """A profile hook that records the config-carrying calls between units (see the module's docstring)."""

    def __init__(self, package: Path, layer: dict[str, int], values: bool = False):
        self.package, self.layer = package, layer
        self.root = str(package)
        self.values = values
        self.types = config_types()
        self.run_config_types = tuple(t for t in self.types if t.__name__ == "RunConfig")
        self.marked: set[int] = set()  # ids of the mappings a checked config holds
        self.keep: list = []  # keeps the marked objects alive, so that their ids stay theirs
        self.units: dict[str, str | None] = {}
        self.moves: dict[tuple[str, str], str] = {}  # (caller unit, callee unit) -> first call seen
        self.rooms: set[str] = set()

    def _unit(self, filename: str) -> str | None:
        if filename not in self.units:
            self.units[filename] = (unit_of_file(filename, self.package, self.layer)
                                    if filename.startswith(self.root) else None)
        return self.units[filename]

    def _is_config(self, value) -> bool:
        if isinstance(value, self.types) or id(value) in self.marked:
            return True
        if isinstance(value, (tuple, list)) and len(value) <= 64:
            return any(isinstance(v, self.types) or id(v) in self.marked for v in value)
        return False

    def _carries(self, value) -> bool:
        """An argument is the config, holds a part of it (a short sequence), or is ``**kwargs`` holding one."""
        if isinstance(value, dict) and id(value) not in self.marked:
            return any(self._is_config(v) for v in value.values())
        return self._is_config(value)

    def _mark(self, config) -> None:
        """The mappings and sequences a checked config holds are the config too (identity, not type); with
        ``values``, so is every float and string read from it, at any depth (ints, bools and None are shared
        objects in CPython, so identity cannot follow them)."""
        def mark(value, depth: int) -> None:
            if id(value) in self.marked or value is None or isinstance(value, (bool, int)):
                return
            if isinstance(value, (float, str)):
                if self.values:
                    self.marked.add(id(value))
                    self.keep.append(value)
                return
            if isinstance(value, (Mapping, list, tuple)):
                self.marked.add(id(value))
                self.keep.append(value)
            if depth == 0 or not self.values:
                return
            if dataclasses.is_dataclass(value):
                children = [getattr(value, f.name) for f in dataclasses.fields(value)]
            elif isinstance(value, Mapping):
                children = [*value.values()]
            elif isinstance(value, (list, tuple)):
                children = [*value]
            else:
                return
            for child in children:
                mark(child, depth - 1)

        for field in dataclasses.fields(config):
            mark(getattr(config, field.name), 4)

    def __call__(self, frame, event, arg):
        if event == "return" and isinstance(arg, self.run_config_types):
            self._mark(arg)
            return
        if event != "call":
            return
        callee = self._unit(frame.f_code.co_filename)
        if callee is None:
            return
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        local = frame.f_locals
        carrier = next((name for name in code.co_varnames[:count] if self._carries(local.get(name))), None)
        if carrier is None:
            return
        caller_frame, caller = frame.f_back, None
        while caller_frame is not None:
            caller = self._unit(caller_frame.f_code.co_filename)
            if caller is not None:
                break
            caller_frame = caller_frame.f_back
        self.rooms.add(callee)
        if caller is None or caller == callee:
            return
        self.rooms.add(caller)
        name = getattr(code, "co_qualname", code.co_name)
        self.moves.setdefault((caller, callee),
                              f"{getattr(caller_frame.f_code, 'co_qualname', caller_frame.f_code.co_name)} -> "
                              f"{name}({carrier}=...)")


def cell_overrides() -> list[str]:
    """certified-budgets' target_0.1 cell on SmolLM2, one item."""
    scale = yaml.safe_load(SCALE.read_text())["exploratory"]["certified-budgets"]
    overrides = [*scale["base"], *scale["models"]["smollm2"], *scale["variants"]["target_0.1"]]
    overrides = [o for o in overrides if not o.startswith(("n_items=", "target_floor="))]
    return ["model=smollm2", *overrides, "n_items=1", "threads=2", "progress=false"]


def measure(overrides: list[str], values: bool = False) -> dict:
    """Run the cell under the hook; returns the units' layers, the walk's moves, its rooms and climbs."""
    from kvcert.hydra_app import compose
    from kvcert.runner.cell import run_cell

    package = package_dir()
    layer = declared_layers(package)
    walk = Walk(package, layer, values)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose([*overrides, f"out_dir={tmp}/cell"])
        sys.setprofile(walk)
        try:
            run_cell(cfg, Path(tmp) / "cell")
        finally:
            sys.setprofile(None)
    climbs = set()
    for caller, callee in walk.moves:
        # The call moves caller -> callee, its return callee -> caller: whichever goes up is a climb.
        if layer[callee] > layer[caller]:
            climbs.add((caller, callee))
        elif layer[caller] > layer[callee]:
            climbs.add((callee, caller))
    return {
        "overrides": overrides,
        "layers": {unit: layer[unit] for unit in sorted(walk.rooms, key=lambda u: (-layer[u], u))},
        "moves": [{"caller": a, "callee": b, "first_call": where} for (a, b), where in walk.moves.items()],
        "climbs": sorted([f"{a} -> {b}" for a, b in climbs]),
        "rooms": len(walk.rooms),
        "n_climbs": len(climbs),
        "n_units": len(layer),
        "n_layers": len(set(layer.values())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overrides", nargs="+", help="the cell's run-config overrides (default: see the docstring)")
    parser.add_argument("--values", action="store_true",
                        help="follow the floats and strings read from the config too, not only its objects")
    parser.add_argument("--json", action="store_true", help="print the measurement as JSON")
    args = parser.parse_args(argv)
    result = measure(args.overrides or cell_overrides(), args.values)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"library: {result['n_units']} units in {result['n_layers']} layers")
    print("rooms (layer):", ", ".join(f"{u} ({n})" for u, n in result["layers"].items()))
    print("moves (caller -> callee, first call):")
    for move in result["moves"]:
        print(f"  {move['caller']} -> {move['callee']}: {move['first_call']}")
    print("climbs:", ", ".join(result["climbs"]))
    print(f"rooms {result['rooms']}, climbs {result['n_climbs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

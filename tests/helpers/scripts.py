"""Load a workflow script (or any Python file) as a module, for tests of code that is not part of the package."""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "workflow" / "scripts"


def load_module(path: Path, name: str, register: bool = False) -> ModuleType:
    """A fresh module from ``path`` on every call; ``register`` puts it in sys.modules under ``name`` first (what
    dataclasses and pickling of the module's objects need)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def workflow_script(name: str, register: bool = False) -> ModuleType:
    """workflow/scripts/<name>.py as a fresh module."""
    return load_module(SCRIPTS / f"{name}.py", name, register)


@functools.lru_cache(maxsize=None)  # one renderer for every docs test: its table caches serve every page
def render_docs() -> ModuleType:
    return workflow_script("render_docs")

"""Publish an executed analysis notebook (rule ``publish_notebook``).

Snakemake's notebook directive executes a copy of the frozen notebook with a first cell (the "preamble")
that unpickles the job object and extends ``sys.path`` with this machine's absolute paths. The published
copy replaces that cell by a short one that names the rule's inputs and outputs relative to the working
directory (so the notebook still reads as what it ran on, and re-runs from there) under a fixed cell id
(Snakemake gives the preamble a random one each run), and drops the cells' execution timestamps. A published
notebook that still holds an absolute path of this machine is refused.
"""

import json
import os
import sys
from pathlib import Path

from kvcert.atomic import write_text_atomic

PREAMBLE_MARK = "snakemake preamble start"


def _relative(value, cwd: Path):
    """Paths under ``cwd``, relative to it (archived studies are read by absolute path)."""
    if isinstance(value, dict):
        return {k: _relative(v, cwd) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_relative(v, cwd) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        path = Path(value).resolve()
        if path == cwd or cwd in path.parents:
            return os.path.relpath(path, cwd)
    return value


def _namespace(name: str, value) -> str:
    if isinstance(value, dict):
        fields = ", ".join(f"{k}={_namespace(k, v)}" for k, v in value.items())
        return f"SimpleNamespace({fields})"
    return repr(value)


def publish(raw: Path, target: Path, inputs: dict, outputs: list, rule: str) -> None:
    notebook = json.loads(raw.read_text())
    cwd = Path.cwd().resolve()
    replaced = 0
    for cell in notebook["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        source = "".join(cell.get("source", []))
        if cell["cell_type"] == "code" and PREAMBLE_MARK in source:
            cell["source"] = [
                f"# Executed by the rule `{rule}`. Snakemake's preamble (it embeds this machine's paths) is replaced\n",
                "# by the rule's inputs and outputs, relative to the working directory of the run.\n",
                "from types import SimpleNamespace\n",
                "\n",
                f"snakemake = SimpleNamespace(input={_namespace('input', _relative(inputs, cwd))}, "
                f"output={_relative(list(outputs), cwd)!r})",
            ]
            cell["outputs"], cell["execution_count"] = [], None
            if "id" in cell:
                cell["id"] = "preamble"
            replaced += 1
    if replaced != 1:
        raise SystemExit(f"{raw}: expected one Snakemake preamble cell, found {replaced}")
    text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
    leaks = sorted({p for p in (str(cwd), os.path.expanduser("~"), sys.prefix) if p and p in text})
    if leaks:
        raise SystemExit(f"{raw}: the published notebook would still contain the absolute path(s) {leaks}")
    write_text_atomic(text, target)


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    publish(Path(sm.params.notebook), Path(sm.output[0]), dict(sm.params.inputs), list(sm.params.outputs), sm.params.rule)

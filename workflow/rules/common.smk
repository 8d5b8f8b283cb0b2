# The scale (--config scale=smoke|default|paper) decides cells, shards, resources and output folders.
import shlex
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError

REPO = Path(workflow.basedir)  # the repository; outputs go to the working directory (--directory)
SCALE_NAME = str(config.get("scale", "default"))
_scale_file = REPO / "workflow" / "scales" / f"{SCALE_NAME}.yaml"
if not _scale_file.is_file():
    _known = sorted(p.stem for p in _scale_file.parent.glob("*.yaml"))
    raise WorkflowError(f"--config scale={SCALE_NAME}: unknown scale; known: {', '.join(_known)}")
S = yaml.safe_load(_scale_file.read_text())

OUT = str(config.get("outdir", S["outdir"]))
FIG = str(config.get("figure_dir", S["figure_dir"] if "outdir" not in config else f"{OUT}/figures"))
MODELS = S["models"]
CLAIMS = ["c1", "c2", "c3", "c4", "c5", "c6", "c7"]


def _expand_matrix(scale):
    """The paper scale lists models x data x settings; smaller scales list their cells directly."""
    cells = dict(scale.get("cells") or {})
    matrix = scale.get("matrix")
    if matrix:
        for model in matrix["models"]:
            for data_name, data_overrides in matrix["data"].items():
                for setting in matrix["settings"]:
                    cells[f"{model}-{data_name}-{setting}"] = {
                        "model": model,
                        "shards": matrix["shards"],
                        "overrides": list(data_overrides) + list(scale["grid"]) + [f"setting={setting}"],
                    }
    return cells


CELLS = _expand_matrix(S)
SHARDS = [(cell, shard) for cell, spec in CELLS.items() for shard in range(spec["shards"])]
CELL_DIRS = [f"{OUT}/cells/{cell}/shard-{shard}" for cell, shard in SHARDS]
CELL_ITEMS = [f"{d}/items.parquet" for d in CELL_DIRS]
CELL_STEPS = [f"{d}/steps.parquet" for d in CELL_DIRS]


def resource(rule_name, key, default):
    return (S.get("resources", {}).get(rule_name) or {}).get(key, default)


def quoted(overrides):
    return " ".join(shlex.quote(str(o)) for o in overrides)

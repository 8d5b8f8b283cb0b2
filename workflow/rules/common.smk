# The scale (--config scale=smoke|default|paper|v1) decides studies, cells, shards, resources and output folders.
#
# A study is one pre-registration version applied to its cells: <outdir>/<study>/cells/<cell>/shard-<k>/,
# <outdir>/<study>/claims/<claim>.json, <figure_dir>/<study>/<claim>.png. A scale lists its studies under
# `studies:` (each with `prereg:` and `cells:`, `cells_from: <study>` to analyse another study's cells, or
# `archived: true` for a study whose committed claim results and accuracy table are read as they are), or
# is one study (top-level `cells:` or `matrix:`, version `prereg:`). The tables pool every study.
import difflib
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError

REPO = Path(workflow.basedir)  # the repository; outputs go to the working directory (--directory)
STARTED = time.time()


def fail(message):
    """Stop while the workflow is parsed, with ``message`` as the one and last line on stderr (exit 1)."""
    print(f"kvcert workflow: error: {message}", file=sys.stderr)
    raise SystemExit(1)


CONFIG_KEYS = ("scale", "outdir", "figure_dir")
for _key in config:
    if _key not in CONFIG_KEYS:
        _close = difflib.get_close_matches(str(_key), CONFIG_KEYS, n=1)
        fail(f"--config {_key}=...: unknown key{f' (did you mean {_close[0]}?)' if _close else ''}; "
             f"known: {', '.join(CONFIG_KEYS)}")
SCALE_NAME = str(config.get("scale", "default"))
_scale_file = REPO / "workflow" / "scales" / f"{SCALE_NAME}.yaml"
if not _scale_file.is_file():
    _known = sorted(p.stem for p in _scale_file.parent.glob("*.yaml"))
    fail(f"--config scale={SCALE_NAME}: unknown scale; known: {', '.join(_known)}")
S = yaml.safe_load(_scale_file.read_text())

# Code fingerprints (kvcert.provenance): a job reruns when the code that decides its numbers changes
# (Snakemake's params rerun trigger), and only then: an edit of README.md reruns nothing.
try:
    from kvcert.provenance import analysis_fingerprint, code_fingerprint
except ImportError as _err:
    fail(f"kvcert is not importable by this snakemake's Python ({_err}): install the project (make install) and "
         "run the snakemake of that environment")
CODE_FINGERPRINT = code_fingerprint()
ANALYSIS_FINGERPRINT = analysis_fingerprint(REPO)

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


def _studies(scale):
    """{study: {"prereg": version, "cells": {cell: spec}, "source": study whose cells it reads, "archived"}}."""
    if "studies" not in scale:
        if not scale.get("cells") and not scale.get("matrix"):
            return {}  # an exploratory-only scale
        version = int(scale.get("prereg", 1))
        return {f"v{version}": {"prereg": version, "cells": _expand_matrix(scale), "source": f"v{version}",
                                "archived": False}}
    out = {}
    for name, spec in scale["studies"].items():
        source = spec.get("cells_from", name)
        if source not in scale["studies"]:
            fail(f"{_scale_file.name}: study {name}: cells_from={source} is not a study of this scale")
        out[name] = {"prereg": int(spec["prereg"]), "cells": _expand_matrix(scale["studies"][source]),
                     "source": source, "archived": bool(spec.get("archived", False))}
    return out


STUDIES = _studies(S)
# Exploratory studies (`exploratory:` in a scale): cells run like any others, analysed by their own rules
# (workflow/rules/exploratory.smk), never by the pre-registered claims. Each lists `base` overrides and
# `variants` (name -> overrides added to the base): one cell per variant.
EXPLORATORY = {
    name: {"cells": {variant: {"model": spec["model"], "shards": spec.get("shards", 1),
                               "overrides": [*spec["base"], *extra]}
                     for variant, extra in spec["variants"].items()}}
    for name, spec in (S.get("exploratory") or {}).items()
}
PREREG_SCALE = str(S.get("prereg_scale", SCALE_NAME))  # the pre-registered scale whose populations it runs
COMPUTED = [name for name, st in STUDIES.items() if not st["archived"]]
ARCHIVED = [name for name, st in STUDIES.items() if st["archived"]]
# Cells are run once per study that owns them (not for a study that reads another's).
CELL_STUDIES = sorted({STUDIES[name]["source"] for name in COMPUTED} | set(EXPLORATORY))
_CELLS_OF = {**{name: STUDIES[name]["cells"] for name in COMPUTED}, **{n: e["cells"] for n, e in EXPLORATORY.items()}}
SHARDS = [(study, cell, shard) for study in CELL_STUDIES for cell, spec in _CELLS_OF[study].items()
          for shard in range(spec["shards"])]
CELLS = {(study, cell): spec for study in CELL_STUDIES for cell, spec in _CELLS_OF[study].items()}


def cell_dirs(study):
    """The cell directories a study's claims (or an exploratory study's rules) read."""
    source = STUDIES[study]["source"] if study in STUDIES else study
    return [f"{OUT}/{source}/cells/{cell}/shard-{shard}" for st, cell, shard in SHARDS if st == source]


CELL_DIRS = [f"{OUT}/{study}/cells/{cell}/shard-{shard}" for study, cell, shard in SHARDS]
CELL_ITEMS = [f"{d}/items.parquet" for d in CELL_DIRS]
CELL_STEPS = [f"{d}/steps.parquet" for d in CELL_DIRS]
# No result may exist before the pre-registration is frozen (kvcert-prereg verify checks its hashes).
from kvcert.analysis.prereg import VERSIONS

for _version in sorted({st["prereg"] for st in STUDIES.values()}):
    if _version not in VERSIONS:
        fail(f"{_scale_file.name}: prereg={_version} is unknown; known: {', '.join(map(str, sorted(VERSIONS)))}")
    for _n in range(1, _version + 1):
        if not (REPO / VERSIONS[_n].lock).is_file():
            _how = "make lock, i.e. kvcert-prereg lock" if _n == 1 else f"kvcert-prereg lock --amendment {_n}"
            fail(f"{REPO / VERSIONS[_n].lock} is missing: freeze the pre-registration first ({_how}) before "
                 "running the pipeline")
for _study in ARCHIVED:
    for _name in [*(f"claims/{c}.json" for c in CLAIMS), "accuracy.csv"]:
        if not Path(f"{OUT}/{_study}/{_name}").is_file():
            fail(f"{OUT}/{_study}/{_name} is missing: study {_study} is archived in scale {SCALE_NAME}; "
                 f"regenerate it with its own scale (e.g. make reproduce-{_study})")


def resource(rule_name, key, default):
    return (S.get("resources", {}).get(rule_name) or {}).get(key, default)


def quoted(overrides):
    return " ".join(shlex.quote(str(o)) for o in overrides)


def report_failure(snakemake_log):
    """``onerror``: end on one line per failed job, the last line of its log (kvcert tools end on their error).

    Snakemake's own summary says only that a job failed; the reason is in the job's log file.
    """
    lines = []
    logs = Path(OUT) / "logs"
    for path in sorted(logs.rglob("*.log")) if logs.is_dir() else []:
        if path.stat().st_mtime < STARTED:
            continue
        text = path.read_text(errors="replace").strip().splitlines()
        if text and "error" in text[-1].lower():
            lines.append(f"{path}: {text[-1].strip()}")
    try:
        verify = subprocess.run(["kvcert-prereg", "--root", str(REPO), "verify"], capture_output=True, text=True)
    except OSError:  # kvcert not on PATH: the job logs still say what failed
        verify = None
    if verify is not None and verify.returncode != 0 and verify.stderr.strip():
        lines.append(verify.stderr.strip().splitlines()[-1])
    if not lines:
        return
    logs_of_run = snakemake_log if isinstance(snakemake_log, (list, tuple)) else [snakemake_log]
    print(f"Complete log: {', '.join(str(p) for p in logs_of_run)}", file=sys.stderr)
    for line in lines:
        print(f"kvcert workflow: error: {line}", file=sys.stderr)
    raise SystemExit(1)

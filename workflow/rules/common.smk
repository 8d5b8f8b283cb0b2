# The scale (--config scale=smoke|default|paper) decides cells, shards, resources and output folders.
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
# No result may exist before the pre-registration is frozen (kvcert-prereg verify checks its hashes).
if not (REPO / "preregistration" / "prereg.lock").is_file():
    fail(f"{REPO / 'preregistration' / 'prereg.lock'} is missing: freeze the pre-registration first "
         "(make lock, i.e. kvcert-prereg lock) before running the pipeline")
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


CELLS = _expand_matrix(S)
SHARDS = [(cell, shard) for cell, spec in CELLS.items() for shard in range(spec["shards"])]
CELL_DIRS = [f"{OUT}/cells/{cell}/shard-{shard}" for cell, shard in SHARDS]
CELL_ITEMS = [f"{d}/items.parquet" for d in CELL_DIRS]
CELL_STEPS = [f"{d}/steps.parquet" for d in CELL_DIRS]


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

# The scale (--config scale=smoke|default|paper|rehearse) decides cells, shards, resources and output folders.
import difflib
import shlex
import subprocess
import sys
import time
from pathlib import Path

from kvcert.scales import (
    ScaleError,
    cell_overrides,
    expand_cells,
    load_scale,
    longbench_subsets,
    needs_longbench_copy,
    shard_list,
)

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
try:
    S = load_scale(SCALE_NAME, _scale_file.parent)
    CELLS = expand_cells(S)
except ScaleError as _err:
    fail(str(_err))

OUT = str(config.get("outdir", S["outdir"]))
FIG = str(config.get("figure_dir", S["figure_dir"] if "outdir" not in config else f"{OUT}/figures"))
MODELS = S["models"]
CLAIMS = ["c1", "c2", "c3", "c4", "c5", "c6", "c7"]
# A derived scale (base + substitutions) is analysed with its base's pre-registered populations.
CLAIM_SCALE = S["claims_scale"]
SHARDS = shard_list(CELLS)
# LongBench cells without a data.path read one local copy, fetched once by rule fetch_longbench.
LONGBENCH_COPY = f"{OUT}/data/longbench"
LONGBENCH_SUBSETS = longbench_subsets(S, CELLS)
CELL_DIRS = [f"{OUT}/cells/{cell}/shard-{shard}" for cell, shard in SHARDS]
CELL_ITEMS = [f"{d}/items.parquet" for d in CELL_DIRS]
CELL_STEPS = [f"{d}/steps.parquet" for d in CELL_DIRS]


def resource(rule_name, key, default):
    return (S.get("resources", {}).get(rule_name) or {}).get(key, default)


def cell_data_inputs(cell):
    return [LONGBENCH_COPY] if needs_longbench_copy(S, cell) else []


def cell_run_overrides(cell):
    """The cell's kvcert-run overrides, pointed at the local LongBench copy when it reads the hub's."""
    extra = [f"data.path={LONGBENCH_COPY}"] if needs_longbench_copy(S, cell) else []
    return cell_overrides(S, cell) + extra


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

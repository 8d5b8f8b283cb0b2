# The scale (--config scale=smoke|default|paper|v1|rehearse|…) decides studies, cells, shards, resources and output folders.
#
# A study is one pre-registration version applied to its cells: <outdir>/<study>/cells/<cell>/shard-<k>/,
# <outdir>/<study>/claims/<claim>.json, <figure_dir>/<study>/<claim>.png. A scale lists its studies under
# `studies:` (each with `prereg:` and `cells:`, `cells_from: <study>` to analyse another study's cells, or
# `archived: true` for a study whose committed claim results and accuracy table are read as they are), or
# is one study (top-level `cells:` or `matrix:`, version `prereg:`). The tables pool every study. A derived
# scale (`base:` + `substitute:`) is its base with some values swapped (kvcert.scales).
import difflib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(workflow.basedir)  # the repository; outputs go to the working directory (--directory)
STARTED = time.time()


def fail(message):
    """Stop while the workflow is parsed, with ``message`` as the one and last line on stderr (exit 1)."""
    print(f"kvcert workflow: error: {message}", file=sys.stderr)
    raise SystemExit(1)


CONFIG_KEYS = ("scale", "outdir", "figure_dir", "archive", "amendment", "campaign")
for _key in config:
    if _key not in CONFIG_KEYS:
        _close = difflib.get_close_matches(str(_key), CONFIG_KEYS, n=1)
        fail(f"--config {_key}=...: unknown key{f' (did you mean {_close[0]}?)' if _close else ''}; "
             f"known: {', '.join(CONFIG_KEYS)}")
SCALE_NAME = str(config.get("scale", "default"))
try:
    from kvcert.scales import (
        ScaleError,
        cell_overrides,
        exploratory,
        load_scale,
        longbench_subsets,
        needs_longbench_copy,
        scale_names,
        scales_folder,
        shard_list,
        studies,
        study_cells,
    )
except ImportError as _err:
    fail(f"kvcert is not importable by this snakemake's Python ({_err}): install the project (make install) and "
         "run the snakemake of that environment")
SCALES = scales_folder(REPO)  # configs/scales: the scale files
_scale_file = SCALES / f"{SCALE_NAME}.yaml"
if not _scale_file.is_file():
    fail(f"--config scale={SCALE_NAME}: unknown scale; known: {', '.join(scale_names(SCALES))}")
try:
    S = load_scale(SCALE_NAME, SCALES)
    STUDIES = studies(S)
    EXPLORATORY = exploratory(S)
    CELLS = study_cells(S)
except ScaleError as _err:
    fail(str(_err))

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

# A campaign (a scale with `campaign: true`, or any outdir with --config campaign=start) records the code and the
# packages it started with in <outdir>/campaign.json: at its first run that has jobs to do (onstart; a dry run
# writes nothing), or at once with --config campaign=start. Every later command on that outdir (the record's
# presence is enough), dry runs included, stops here with one line naming what changed (kvcert.campaign) when the
# code or packages differ, instead of rerunning every cell; --config campaign=restart records the present as a
# new start (earlier starts stay in the file). Only the controller checks: the jobs it submits are not checked.
CAMPAIGN_MODES = ("start", "restart")
CAMPAIGN_RECORD = f"{OUT}/campaign.json"
_campaign = config.get("campaign")
if _campaign is not None and str(_campaign) not in CAMPAIGN_MODES:
    fail(f"--config campaign={_campaign}: unknown; known: {', '.join(CAMPAIGN_MODES)}")
if not isinstance(S.get("campaign", False), bool):
    fail(f"{_scale_file.name}: campaign={S['campaign']!r}: expected true or false")
CAMPAIGN = bool(S.get("campaign") or _campaign is not None or Path(CAMPAIGN_RECORD).exists()) and workflow.is_main_process


def ensure_campaign():
    """Start, continue or (--config campaign=restart) restart the campaign of OUT; stops on a changed library."""
    from kvcert.campaign import CampaignChanged, CampaignRecordError, ensure

    try:
        state = ensure(CAMPAIGN_RECORD, SCALE_NAME, restart=str(_campaign) == "restart")
    except (CampaignChanged, CampaignRecordError) as err:
        fail(str(err))
    if state != "continued":
        print(f"kvcert workflow: campaign {state}: {CAMPAIGN_RECORD}", file=sys.stderr)


if CAMPAIGN and (_campaign is not None or Path(CAMPAIGN_RECORD).exists()):
    ensure_campaign()


onstart:
    if CAMPAIGN and not Path(CAMPAIGN_RECORD).exists():
        ensure_campaign()


CLAIMS = ["c1", "c2", "c3", "c4", "c5", "c6", "c7"]
# The pre-registered scale whose claim populations apply: the scale's `prereg_scale`, else the root of
# its `base` chain (a derived scale is analysed with its base's populations).
PREREG_SCALE = str(S.get("prereg_scale", S["claims_scale"]))
COMPUTED = [name for name, st in STUDIES.items() if not st["archived"]]
ARCHIVED = [name for name, st in STUDIES.items() if st["archived"]]
# Cells are run once per study that owns them (not for a study that reads another's).
CELL_STUDIES = sorted({study for study, _ in CELLS})
SHARDS = [(study, cell, shard) for (study, cell), shard in shard_list(CELLS)]
# LongBench cells without a data.path read one local copy, fetched once by rule fetch_longbench, or, where the
# environment names one (KVCERT_LONGBENCH_COPY, set by the env file kvcert-stage writes), that staged copy,
# which no rule makes.
LONGBENCH_STAGED = os.environ.get("KVCERT_LONGBENCH_COPY") or None
LONGBENCH_COPY = LONGBENCH_STAGED or f"{OUT}/data/longbench"
LONGBENCH_SUBSETS = longbench_subsets(S, CELLS)
if LONGBENCH_STAGED:
    _absent = [s for s in LONGBENCH_SUBSETS if not (Path(LONGBENCH_STAGED) / f"{s}.jsonl").is_file()]
    if _absent:
        fail(f"KVCERT_LONGBENCH_COPY={LONGBENCH_STAGED}: no {_absent[0]}.jsonl there (scale {SCALE_NAME} reads "
             f"{', '.join(LONGBENCH_SUBSETS)}); stage them with kvcert-stage or unset it")


def cell_dirs(study):
    """The cell directories a study's claims (or an exploratory study's rules) read."""
    source = STUDIES[study]["source"] if study in STUDIES else study
    return [f"{OUT}/{source}/cells/{cell}/shard-{shard}" for st, cell, shard in SHARDS if st == source]


CELL_DIRS = [f"{OUT}/{study}/cells/{cell}/shard-{shard}" for study, cell, shard in SHARDS]
CELL_ITEMS = [f"{d}/items.parquet" for d in CELL_DIRS]
CELL_STEPS = [f"{d}/steps.parquet" for d in CELL_DIRS]
# No result may exist before the pre-registration is frozen (kvcert-prereg verify checks its hashes).
from kvcert.analysis.prereg import versions as _prereg_versions

VERSIONS = _prereg_versions(REPO)  # derived from preregistration/'s data (versions.yaml and amendment folders)
for _version in sorted({st["prereg"] for st in STUDIES.values()}):
    if _version not in VERSIONS:
        fail(f"{_scale_file.name}: prereg={_version} is unknown; known: {', '.join(map(str, sorted(VERSIONS)))}")
    for _n in range(1, _version + 1):
        if not (REPO / VERSIONS[_n].lock).is_file():
            _how = "make lock, i.e. kvcert-prereg lock" if _n == 1 else f"kvcert-prereg lock --amendment {_n}"
            fail(f"{REPO / VERSIONS[_n].lock} is missing: freeze the pre-registration first ({_how}) before "
                 "running the pipeline")
# Archived studies are read where they are committed (the scale's outdir in the repository), whatever
# --config outdir says; --config archive=DIR reads them from DIR instead (make verify-results does).
ARCHIVE = str(config.get("archive", REPO / S["outdir"]))


def study_dir(study):
    """Where a study's claim results and accuracy table are: the archive for archived studies, else OUT."""
    return f"{ARCHIVE}/{study}" if study in ARCHIVED else f"{OUT}/{study}"


for _study in ARCHIVED:
    for _name in [*(f"claims/{c}.json" for c in CLAIMS), "accuracy.csv"]:
        if not Path(f"{study_dir(_study)}/{_name}").is_file():
            fail(f"{study_dir(_study)}/{_name} is missing: study {_study} is archived in scale {SCALE_NAME}; "
                 f"regenerate it with its own scale (e.g. make reproduce-{_study})")


def resource(rule_name, key, default):
    return (S.get("resources", {}).get(rule_name) or {}).get(key, default)


def cell_data_inputs(cell):
    """The LongBench copy a cell reads (rule fetch_longbench), or nothing (none, or a staged one)."""
    return [LONGBENCH_COPY] if needs_longbench_copy(S, cell) and not LONGBENCH_STAGED else []


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

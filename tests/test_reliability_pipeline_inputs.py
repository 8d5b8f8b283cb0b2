"""Issue #6: bad input to ``kvcert-claim``, ``kvcert-prereg`` and the Snakemake DAG.

Same contract as tests/test_reliability_run_inputs.py: non-zero exit, the LAST line of stderr names the key,
value, file or line at fault, and nothing is written (no claim JSON, no figures, no DAG outputs).
Everything runs on temporary copies: the repository's preregistration/ and analysis files (with the
repository's own lock, so the clean copy must verify), synthetic cells, and a copy of the workflow.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcert.analysis import cli, synthetic
from kvcert.scales import scale_names, scales_folder

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "TOKENIZERS_PARALLELISM": "false"}


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _copy_prereg(dst: Path, with_lock: bool = True) -> Path:
    """preregistration/ and the frozen analysis sources, with the repository's lock."""
    ignore = ["__pycache__"] + ([] if with_lock else ["prereg.lock"])
    shutil.copytree(ROOT / "preregistration", dst / "preregistration", ignore=shutil.ignore_patterns(*ignore))
    shutil.copytree(ROOT / "src" / "kvcert" / "analysis", dst / "src" / "kvcert" / "analysis",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dst


# --- kvcert-prereg verify --root <copy> -----------------------------------------------------------------


def _edit_claims(root: Path) -> None:
    path = root / "preregistration" / "claims.yaml"
    text = path.read_text()
    assert "threshold: -2.0" in text
    path.write_text(text.replace("threshold: -2.0", "threshold: -5.0", 1))


def _edit_stats(root: Path) -> None:
    path = root / "src" / "kvcert" / "analysis" / "stats.py"
    path.write_text(path.read_text() + "\n# an edit after the lock\n")


def _drop_lock(root: Path) -> None:
    (root / "preregistration" / "prereg.lock").unlink()


def _corrupt_lock(root: Path) -> None:
    (root / "preregistration" / "prereg.lock").write_text("{not json")


def _drop_frozen_file(root: Path) -> None:
    (root / "src" / "kvcert" / "analysis" / "replay.py").unlink()


PREREG_CASES = [
    ("claims-edited", _edit_claims, "preregistration/claims.yaml changed since the lock"),
    ("analysis-code-edited", _edit_stats, "src/kvcert/analysis/stats.py changed since the lock"),
    ("lock-missing", _drop_lock, "preregistration/prereg.lock is missing"),
    ("lock-corrupt", _corrupt_lock, "preregistration/prereg.lock is not a valid lock file"),
    ("frozen-file-missing", _drop_frozen_file, "src/kvcert/analysis/replay.py is missing"),
]


def _prereg(*args):
    return subprocess.run([str(BIN / "kvcert-prereg"), *args], capture_output=True, text=True, env=ENV, timeout=120)


def test_prereg_verify_passes_on_an_unedited_copy(tmp_path):
    from kvcert.analysis import heldout, prereg

    proc = _prereg("--root", str(_copy_prereg(tmp_path)), "verify")
    assert proc.returncode == 0, proc.stderr
    # Every locked version of the repository is verified in the copy, each with its lock's file count and time.
    locked = [n for n, known in sorted(prereg.versions(ROOT).items()) if (ROOT / known.lock).is_file()]
    assert locked[0] == 1 and len(locked) >= 5
    drafts = [n for n in sorted(prereg.versions(ROOT)) if n not in locked]  # a draft amendment: named, not verified
    assert proc.stdout.strip() == "; ".join(
        [f"version {n} lock OK ({len(lock['files'])} files, locked {lock['locked_at_utc']})"
         for n, lock in ((n, prereg.read_lock(ROOT, n)) for n in locked)]
        + [f"version {n} is a draft (not locked)" for n in drafts]
        + [f"exploratory {scale} lock OK ({len(lock['files'])} files, locked {lock['locked_at_utc']})"
           for scale, lock in ((s, json.loads((ROOT / "preregistration" / "exploratory" / f"{s}.lock").read_text()))
                               for s in heldout.locked_scales(ROOT))])


@pytest.mark.parametrize("edit, expected", [pytest.param(*c[1:], id=c[0]) for c in PREREG_CASES])
def test_prereg_verify_refuses_an_edited_copy(edit, expected, tmp_path):
    root = _copy_prereg(tmp_path)
    edit(root)
    proc = _prereg("--root", str(root), "verify")
    assert proc.returncode != 0
    last = _last_line(proc.stderr)
    assert last.startswith("kvcert-prereg: error: ") and expected in last, proc.stderr


# --- kvcert-claim ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def claim_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("claim_inputs")
    _copy_prereg(work / "repo")
    edited = _copy_prereg(work / "edited")
    _edit_claims(edited)
    _copy_prereg(work / "unlocked", with_lock=False)
    small = synthetic.SynthSpec(n_items=12, settings=("question_aware",), n_seeds=1)
    synthetic.write_cell(work / "cells" / "qa", small)
    (work / "cells" / "no_steps").mkdir(parents=True)
    shutil.copy(work / "cells" / "qa" / "items.parquet", work / "cells" / "no_steps" / "items.parquet")
    (work / "cells" / "corrupt").mkdir()
    for table in ("items", "steps"):
        (work / "cells" / "corrupt" / f"{table}.parquet").write_bytes(os.urandom(300))
    (work / "a_file").write_text("not a directory\n")
    return work


QA = "cells=[{w}/cells/qa]"
# (id, overrides, text the last stderr line must contain); {w} is the work directory.
CLAIM_CASES = [
    ("claim-missing", [QA], "claim is required: claim=<one of c1, c2, c3, c4, c5, c6, c7>"),
    ("claim-unknown", ["claim=c9", QA], "claim=c9 is not one of c1, c2, c3, c4, c5, c6, c7"),
    ("cells-empty", ["claim=c3"], "cells=[] is empty"),
    ("cells-not-a-list", ["claim=c3", "cells={w}/cells/qa"], "cells='{w}/cells/qa': expected a list of cell directories"),
    ("cell-dir-missing", ["claim=c3", "cells=[{w}/cells/qa,{w}/cells/absent]"], "{w}/cells/absent: missing cell directory"),
    ("cell-table-missing", ["claim=c3", "cells=[{w}/cells/no_steps]"], "{w}/cells/no_steps/steps.parquet: missing"),
    ("cell-table-corrupt", ["claim=c1", "cells=[{w}/cells/corrupt]"], "{w}/cells/corrupt/items.parquet: unreadable parquet"),
    ("population-missing", ["claim=c7", QA], "no rows with setting=streaming"),
    ("n-boot-not-int", ["claim=c3", QA, "n_boot=abc"], "n_boot='abc': expected an integer or null"),
    ("n-boot-zero", ["claim=c3", QA, "n_boot=0"], "n_boot=0: must be >= 1"),
    ("key-typo", ["claim=c3", QA, "nboot=100"], "nboot: unknown key (did you mean n_boot?)"),
    ("key-appended", ["claim=c3", QA, "+budgets=[0.5]"], "budgets: unknown key"),
    ("scale-unknown", ["claim=c3", QA, "scale=huge"], "scale=huge: unknown; known: default, paper, smoke"),
    ("out-under-a-file", ["claim=c3", QA, "out={w}/a_file/c3.json"], "out={w}/a_file/c3.json: {w}/a_file is not a directory"),
    ("figure-dir-under-a-file", ["claim=c3", QA, "figure_dir={w}/a_file/figs"], "figure_dir={w}/a_file/figs: {w}/a_file is not a directory"),
    ("prereg-edited", ["claim=c1", QA, "prereg_root={w}/edited"], "preregistration/claims.yaml changed since the lock"),
    ("prereg-unlocked", ["claim=c1", QA, "prereg_root={w}/unlocked"], "preregistration/prereg.lock is missing"),
    ("prereg-root-missing", ["claim=c1", QA, "prereg_root={w}/nowhere"], "preregistration/versions.yaml is missing"),
    ("bad-interpolation", ["claim=c3", QA, "out=${{nothing}}.json"], "nothing"),
]


def _claim_argv(work: Path, overrides: list[str], tmp_path: Path) -> list[str]:
    argv = [o.replace("{w}", str(work)).replace("{{", "{").replace("}}", "}") for o in overrides]
    defaults = {"prereg_root": str(work / "repo"), "out": str(tmp_path / "claims" / "c.json"),
                "figure_dir": str(tmp_path / "figures"), "n_boot": "50"}
    given = {a.split("=", 1)[0] for a in argv}
    return argv + [f"{k}={v}" for k, v in defaults.items() if k not in given]


@pytest.mark.parametrize("overrides, expected", [pytest.param(*c[1:], id=c[0]) for c in CLAIM_CASES])
def test_claim_bad_input_is_one_line_and_writes_nothing(overrides, expected, claim_work, tmp_path, capsys):
    argv = _claim_argv(claim_work, overrides, tmp_path)
    rc = cli.main(argv)
    err = capsys.readouterr().err
    last = _last_line(err)
    assert rc == cli.EXIT_BAD_INPUT, err
    assert last.startswith("kvcert-claim: error: ") and expected.replace("{w}", str(claim_work)) in last, last
    assert not (tmp_path / "claims").exists() and not (tmp_path / "figures").exists()
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.png"))


def test_claim_runs_on_good_input(claim_work, tmp_path, capsys):
    """The same fixture with good input works (so the rows above fail for the reason they name)."""
    argv = _claim_argv(claim_work, ["claim=c3", QA], tmp_path)
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert (tmp_path / "claims" / "c.json").is_file() and (tmp_path / "figures" / "c3.png").is_file()


@pytest.mark.parametrize("case", ["claim-unknown", "prereg-edited"])
def test_claim_console_script(case, claim_work, tmp_path):
    overrides, expected = next(c[1:] for c in CLAIM_CASES if c[0] == case)
    argv = _claim_argv(claim_work, overrides, tmp_path)
    proc = subprocess.run([str(BIN / "kvcert-claim"), *argv], capture_output=True, text=True, env=ENV, timeout=300)
    last = _last_line(proc.stderr)
    assert proc.returncode == cli.EXIT_BAD_INPUT, proc.stderr
    assert last.startswith("kvcert-claim: error: ") and expected.replace("{w}", str(claim_work)) in last, last
    assert not (tmp_path / "claims").exists() and not (tmp_path / "figures").exists()


# --- the Snakemake DAG, on a copy of the workflow ---------------------------------------------------------


def copy_workflow(dst: Path, with_lock: bool = True) -> Path:
    """Snakefile, workflow/, configs/ (the scale files), preregistration/ (+ lock) and the frozen analysis files: a
    runnable DAG copy (workflow/scales stays a link to configs/scales, as in the repository)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "Snakefile", dst / "Snakefile")
    shutil.copytree(ROOT / "workflow", dst / "workflow", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".slurm"))
    shutil.copytree(ROOT / "configs", dst / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    return _copy_prereg(dst, with_lock=with_lock)


def snakemake(repo: Path, *args, timeout=600):
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=repo, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


DAG_CASES = [
    ("scale-unknown", ["--config", "scale=huge"], "kvcert workflow: error: --config scale=huge: unknown scale; known: " + ", ".join(scale_names(scales_folder(ROOT)))),
    ("config-key-typo", ["--config", "scal=smoke"], "kvcert workflow: error: --config scal=...: unknown key (did you mean scale?)"),
    ("config-key-unknown", ["--config", "scale=smoke", "cores=4"], "kvcert workflow: error: --config cores=...: unknown key"),
]


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("dag") / "repo")


@pytest.mark.parametrize("args, expected", [pytest.param(*c[1:], id=c[0]) for c in DAG_CASES])
# The Snakefile checks --config before any job is planned, the same way for a run and a dry run: the run (which
# could write) in make test, the dry run in make test-full (test_workflow.py checks one dry run's line in make test).
@pytest.mark.parametrize("dry", [pytest.param(True, marks=pytest.mark.slow, id="dry-run"), pytest.param(False, id="run")])
def test_dag_bad_config_is_one_line(args, expected, dry, workflow_copy):
    before = sorted(p.name for p in workflow_copy.iterdir())
    proc = snakemake(workflow_copy, *(["-n"] if dry else ["--cores", "1"]), *args)
    assert proc.returncode != 0
    assert _last_line(proc.stderr) == expected or expected in _last_line(proc.stderr), proc.stderr[-2000:]
    assert not (workflow_copy / "results").exists()
    assert sorted(p.name for p in workflow_copy.iterdir() if p.name != ".snakemake") == [n for n in before if n != ".snakemake"]


def test_dag_without_lock_refuses_to_start(tmp_path):
    repo = copy_workflow(tmp_path / "repo", with_lock=False)
    proc = snakemake(repo, "--cores", "1", "--config", "scale=smoke", "outdir=results/x")
    assert proc.returncode != 0
    last = _last_line(proc.stderr)
    assert last.startswith("kvcert workflow: error: ") and "preregistration/prereg.lock is missing" in last, proc.stderr[-2000:]
    assert not (repo / "results").exists()


def test_dag_with_edited_preregistration_stops_at_verification(tmp_path):
    """The verification job fails; the DAG's last line is the reason (kvcert-prereg's one line)."""
    repo = copy_workflow(tmp_path / "repo")
    _edit_claims(repo)
    proc = snakemake(repo, "--cores", "1", "results/x/logs/preregistration-v1.verified", "--config", "scale=smoke",
                     "outdir=results/x")
    assert proc.returncode != 0
    last = _last_line(proc.stderr)
    assert last.startswith("kvcert workflow: error: ") and "preregistration/claims.yaml changed since the lock" in last, \
        proc.stderr[-2000:]
    assert not (repo / "results" / "x" / "logs" / "preregistration-v1.verified").exists()
    assert not list((repo / "results").rglob("*.json"))


BAD_SCALE = """\
outdir: results/bad
figure_dir: results/bad/figures
threads_per_cell: 1
models:
  smollm2: [model=smollm2]
cells:
  qa:
    model: smollm2
    shards: 1
    overrides: [data=ruler, data.context_tokens=200, n_items=2, 'policies=[snapkv]', 'designs=[poisson]',
                'budgets=[0.25,2]', 'seeds=[0]']
"""


@pytest.mark.smollm2
@pytest.mark.slow  # make test-full: a real DAG whose cell job starts kvcert-run, which loads the model and fails
def test_dag_cell_with_bad_override_names_it_last(workflow_copy):
    """A scale whose cell has budget 2: the cell job fails and the DAG ends on its log's error line."""
    (scales_folder(workflow_copy) / "bad.yaml").write_text(BAD_SCALE)
    target = "results/bad/v1/cells/qa/shard-0/items.parquet"
    proc = snakemake(workflow_copy, "--cores", "1", target, "--config", "scale=bad")
    assert proc.returncode != 0
    last = _last_line(proc.stderr)
    assert last == ("kvcert workflow: error: results/bad/logs/cells/v1-qa-0.log: "
                    "kvcert-run: error: budgets: 2.0 is outside (0, 1]"), proc.stderr[-3000:]
    assert not (workflow_copy / "results" / "bad" / "v1" / "cells").exists()

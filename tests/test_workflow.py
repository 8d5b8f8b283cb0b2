"""The Snakemake DAG: dry-runs of every scale, bad scales, and the smoke scale end to end (real jobs).

The end-to-end test runs the real pipeline (SmolLM2, kvcert-run, kvcert-claim, notebooks) on the smoke
scale; it takes a few minutes on 2 cores. Its claims and reproduction tables must equal the committed
reference (results/smoke-reference/) byte for byte on the reference's numeric platform (its platform.json),
so that any change of a number is a reviewed diff of that reference; then an edit of the library must make
Snakemake rerun every cell and claim, and an edit of README.md nothing.
"""

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvcert.provenance import numeric_platform
from kvcert.scales import load_scale, scales_folder, shard_list, studies, study_cells

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
CLAIM_COLUMNS = ["claim", "estimate", "ci_low", "ci_high", "threshold", "verdict", "paper_verdict", "agrees"]


def snakemake(*args, timeout=1800):
    return subprocess.run(
        [str(BIN / "snakemake"), *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


REFERENCE = ROOT / "results" / "smoke-reference"


def _compare_results():
    spec = importlib.util.spec_from_file_location("compare_results", ROOT / "workflow" / "scripts" / "compare_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare_with_reference(out: Path) -> None:
    """Byte for byte where the reference's platform.json states this machine's numeric platform on every
    component (CPU model and instruction sets, compiler, torch's CPU capability, versions); elsewhere,
    including a reference written before those components were recorded, the same verdicts and numbers within
    the tolerance: the rule make verify-results applies, from the same code (workflow/scripts/compare_results.py)."""
    compare_results = _compare_results()
    same_platform, why = compare_results.choose_comparison(
        json.loads((REFERENCE / "platform.json").read_text()), numeric_platform())
    print(why)
    for name in ("claims.csv", "reproduction.csv"):
        fresh, reference = (out / name).read_bytes(), (REFERENCE / name).read_bytes()
        if same_platform:
            assert fresh == reference, (
                f"{name} differs from results/smoke-reference/{name}: a change of numbers must be a reviewed "
                f"diff of the reference (copy the new table there when the change is intended)")
        else:
            studies = sorted(set(pd.read_csv(REFERENCE / name)["study"]))
            assert compare_results.compare_table(REFERENCE / name, out / name, studies, byte_for_byte=False) == []


def derived_verdict(claim: str, components: list[dict]) -> str:
    """The verdict preregistration/claims.yaml's verdict_rule gives the components' intervals, written out
    here apart from the analysis code (kvcert.analysis.verdicts), with the thresholds, directions and null
    margins claims.yaml freezes (amendments 2 and 3 change none of them)."""
    rules = {c["id"]: c["decision"]["components"] for c in yaml.safe_load(CLAIMS_YAML.read_text())["claims"]}
    verdicts = []
    for component in components:
        rule = rules[claim][component["name"].split("[")[0]]  # accuracy_change[snapkv,topk,0.25] -> accuracy_change
        lo, hi, t = component["ci_low"], component["ci_high"], float(rule["threshold"])
        margin = float(rule.get("null_margin", 0.0))
        if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
            verdicts.append("inconclusive")
            continue
        if rule.get("direction", "greater") == "less":  # mirrored: the hypothesis side is below t
            lo, hi, t = -hi, -lo, -t
        verdicts.append("supported" if lo > t else "not supported" if hi < t + margin else "inconclusive")
    if all(v == "supported" for v in verdicts):
        return "supported"
    return "not supported" if "not supported" in verdicts else "inconclusive"


def check_verdicts(out: Path, claims: pd.DataFrame) -> None:
    """Each row's verdict and agreement against the ones derived from its claim's intervals (the claim
    JSON of its study under ``out``) and claims.yaml; its threshold against claims.yaml's."""
    paper = {c["id"]: c["paper_verdict"] for c in yaml.safe_load(CLAIMS_YAML.read_text())["claims"]}
    for row in claims.itertuples():
        result = json.loads((out / row.study / "claims" / f"{row.claim}.json").read_text())
        components = result["details"]["components"]
        expected = derived_verdict(row.claim, components)
        assert (row.verdict, result["verdict"]) == (expected, expected), (row.study, row.claim)
        assert row.paper_verdict == paper[row.claim]
        assert row.agrees == ("n/a" if expected == "inconclusive" else "yes" if expected == paper[row.claim] else "no")
        shown = [c for c in components if c["name"] == row.component]
        assert len(shown) == 1 and row.threshold == shown[0]["threshold"], (row.study, row.claim, row.component)


CLAIMS_YAML = ROOT / "preregistration" / "claims.yaml"


def test_committed_verdicts_follow_from_their_intervals_and_the_preregistered_thresholds():
    claims = pd.read_csv(ROOT / "results" / "claims.csv", keep_default_na=False, na_values=[""])
    assert len(claims) == 7 * claims["study"].nunique()
    check_verdicts(ROOT / "results", claims)


def scheduled_jobs(proc) -> dict[str, int]:
    """Jobs per rule that a dry run lists (its job-stats table)."""
    counts = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job"):
            counts[parts[0]] = int(parts[1])
    return counts


def _powered(path) -> bool:
    """Whether a scale reads an amendment's powered design (thousands of cell jobs, a cluster's: v5-full, v6-full)."""
    return any(isinstance(study, dict) and str((study.get("design") or {}).get("study", "")).startswith("powered.")
               for study in (yaml.safe_load(path.read_text()).get("studies") or {}).values())


# A powered design's DAG takes most of a minute to build on 2 cores: its dry run is make test-full's (marked slow),
# as are the dry runs of the scales whose shape another one shares (a record of versions 1-3 as v4's, the further
# certified and exploratory scales as certified-budgets-floor's): make test keeps one scale of each shape.
DRY_RUNS_IN_MAKE_TEST = ("default", "smoke", "v4", "v5", "rehearse", "paper", "certified-budgets-floor",
                         "certified-budgets-heldout-3")


@pytest.mark.parametrize("scale", [pytest.param(p.stem, marks=[pytest.mark.slow]
                                                if _powered(p) or p.stem not in DRY_RUNS_IN_MAKE_TEST else [])
                                   for p in sorted(scales_folder(ROOT).glob("*.yaml"))])
def test_dry_run_is_clean(scale, scale_dag):
    # The whole DAG, every job forced (one dry run per scale and session, shared with the other DAG tests).
    jobs = scale_dag(scale)
    loaded = load_scale(scale, scales_folder(ROOT))
    computed = [name for name, study in studies(loaded).items() if not study["archived"]]
    # One cell job per shard of every study's cells, seven claims per computed study.
    assert (jobs.get("cell", 0), jobs.get("claim", 0)) == (len(shard_list(study_cells(loaded))), 7 * len(computed)), jobs
    # The design rules write an amendment's locked files (its timing from wall-clock times): only an explicit
    # `make pilot-amendment` may run them, never a scale's DAG, not even with every job forced.
    design_rules = re.findall(r"^rule (\w+):", (ROOT / "workflow" / "rules" / "design.smk").read_text(), re.M)
    assert design_rules and not set(design_rules) & set(jobs), jobs


def test_unknown_scale_is_one_clear_line():
    proc = snakemake("-n", "--config", "scale=huge")
    assert proc.returncode != 0
    known = ", ".join(sorted(p.stem for p in scales_folder(ROOT).glob("*.yaml")))
    assert f"--config scale=huge: unknown scale; known: {known}" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.smollm2
def test_smoke_dag_end_to_end(tmp_path):
    # The canonical smoke folder (git-ignored), rebuilt from scratch; kept afterwards so that
    # `make test-slurm` can compare the SLURM run's claims with it.
    out = "results/smoke"
    shutil.rmtree(ROOT / out, ignore_errors=True)
    proc = snakemake("--cores", "2", "--config", "scale=smoke", f"outdir={out}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    claims = pd.read_csv(ROOT / out / "claims.csv", keep_default_na=False, na_values=[""])
    smoke = studies(load_scale("smoke", scales_folder(ROOT)))  # every study computed, seven claims each
    assert list(zip(claims["study"], claims["prereg"], claims["claim"])) == [
        (name, study["prereg"], f"c{i}") for name, study in smoke.items() for i in range(1, 8)]
    for column in CLAIM_COLUMNS:
        assert column in claims.columns
    check_verdicts(ROOT / out, claims)
    figures = sorted((ROOT / out / "figures").glob("*/*.png"))
    assert {f"{p.parent.name}/{p.stem}" for p in figures} >= {f"{name}/c{i}" for name in smoke for i in range(1, 8)}
    for name in ("claims.md", "claims.tex", "reproduction.csv"):
        assert (ROOT / out / name).stat().st_size > 0
    executed = json.loads((ROOT / out / "notebooks" / "claims.ipynb").read_text())
    assert any(cell.get("outputs") for cell in executed["cells"] if cell["cell_type"] == "code")
    text = (ROOT / out / "notebooks" / "claims.ipynb").read_text()
    assert str(ROOT) not in text and os.path.expanduser("~") not in text  # no machine path is published
    compare_with_reference(ROOT / out)
    verify_finished_run(ROOT / out, tmp_path)
    # A finished DAG is up to date: a rerun schedules nothing.
    again = snakemake("-n", "--config", "scale=smoke", f"outdir={out}")
    assert "Nothing to be done" in again.stdout + again.stderr
    # An edit of README.md reruns nothing; an edit of the library reruns every cell and every claim after them.
    readme = ROOT / "README.md"
    original = readme.read_bytes()
    try:
        readme.write_bytes(original + b"\nA line.\n")
        assert "Nothing to be done" in snakemake("-n", "--config", "scale=smoke", f"outdir={out}").stdout
    finally:
        readme.write_bytes(original)
    package = tmp_path / "edited" / "kvcert"
    shutil.copytree(ROOT / "src" / "kvcert", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "estimator.py").write_text((package / "estimator.py").read_text() + "\n# an edit\n")
    edited = subprocess.run([str(BIN / "snakemake"), "-n", "--config", "scale=smoke", f"outdir={out}"], cwd=ROOT,
                            env={**ENV, "PYTHONPATH": str(package.parent)}, capture_output=True, text=True, timeout=600)
    jobs = scheduled_jobs(edited)
    smoke = load_scale("smoke", scales_folder(ROOT))
    computed = [name for name, study in studies(smoke).items() if not study["archived"]]
    assert (jobs.get("cell"), jobs.get("claim")) == (len(shard_list(study_cells(smoke))), 7 * len(computed)), \
        edited.stdout[-3000:]
    report = snakemake("--report", str(tmp_path / "report.html"), "--config", "scale=smoke", f"outdir={out}")
    assert report.returncode == 0, report.stderr[-2000:]
    assert (tmp_path / "report.html").stat().st_size > 10_000


def verify_finished_run(out, tmp_path):
    """The runbook's last step (workflow/scripts/verify_campaign.py) passes the finished smoke run, the installed
    packages being the lock's, and names a table changed after its manifest was written (in a copy)."""
    script = [str(BIN / "python"), str(ROOT / "workflow" / "scripts" / "verify_campaign.py"), "--scale", "smoke"]
    lock = ROOT / "requirements" / "lock-cpu.txt"
    passed = subprocess.run([*script, "--outdir", str(out), "--lock", str(lock)], capture_output=True, text=True)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.count("PASS") == 6 and "FAIL" not in passed.stdout
    copy = tmp_path / "smoke-copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("*.ipynb", "figures"))
    items = sorted(copy.rglob("items.parquet"))[0]
    items.write_bytes(items.read_bytes() + b"\0")
    (sorted(copy.rglob("manifest.json"))[-1]).unlink()
    failed = subprocess.run([*script, "--outdir", str(copy)], capture_output=True, text=True)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    lines = failed.stdout.splitlines()
    assert any(l.startswith("verify-campaign: FAIL") and "1 missing" in l for l in lines), failed.stdout
    assert any(l.startswith("verify-campaign: FAIL") and str(items.relative_to(copy)) in l for l in lines), failed.stdout


def _publish_notebook():
    spec = importlib.util.spec_from_file_location("publish_notebook", ROOT / "workflow" / "scripts" / "publish_notebook.py")
    publish = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(publish)
    return publish


def test_published_notebook_names_archived_inputs_relative_to_the_run(tmp_path, monkeypatch):
    """An archived study's claims are read by absolute path (the repository's copy); the published notebook
    names them relative to the working directory, and still refuses a path of this machine elsewhere."""
    publish = _publish_notebook()
    monkeypatch.chdir(tmp_path)
    raw = tmp_path / "executed.ipynb"
    raw.write_text(json.dumps({"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": 1,
                                          "source": [f"# {publish.PREAMBLE_MARK}\n", f"x = {str(tmp_path)!r}\n"]}],
                               "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    archived = str(tmp_path / "results" / "v1" / "claims" / "c1.json")
    publish.publish(raw, tmp_path / "out.ipynb", {"claim_json": [archived, "results/v2/claims/c1.json"]},
                    ["results/notebooks/claims_summary.md"], "notebook_claims")
    text = (tmp_path / "out.ipynb").read_text()
    assert "'results/v1/claims/c1.json'" in text and str(tmp_path) not in text
    with pytest.raises(SystemExit, match="absolute path"):
        publish.publish(raw, tmp_path / "again.ipynb", {"claim_json": [os.path.expanduser("~/elsewhere/c1.json")]},
                        [], "notebook_claims")
    assert not (tmp_path / "again.ipynb").exists()


def test_published_notebook_is_the_same_bytes_whatever_id_snakemake_gives_its_preamble(tmp_path, monkeypatch):
    publish = _publish_notebook()
    monkeypatch.chdir(tmp_path)
    published = []
    for run, cell_id in enumerate(("12113d24", "c46c6cf7")):  # two ids Snakemake gave the same notebook's preamble
        raw = tmp_path / f"executed-{run}.ipynb"
        raw.write_text(json.dumps({"cells": [{"cell_type": "code", "id": cell_id, "metadata": {}, "outputs": [],
                                              "execution_count": 1, "source": [f"# {publish.PREAMBLE_MARK}\n"]}],
                                   "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
        publish.publish(raw, tmp_path / f"out-{run}.ipynb", {"claims": "results/claims.csv"}, [], "notebook_claims")
        published.append((tmp_path / f"out-{run}.ipynb").read_bytes())
    assert published[0] == published[1] and b'"id": "preamble"' in published[0]


def test_scripts_run_by_snakemake_compile_after_its_preamble():
    """Snakemake's `script:` puts its own preamble before a script's first line, so a `from __future__`
    import there is a SyntaxError at run time only (the sensitivity table once failed this way after its
    cells had run); compile every such script as Snakemake will run it."""
    import re

    scripts = []
    for rules in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        for name in re.findall(r'^\s+script:\s*\n\s+"([^"]+)"', rules.read_text(), flags=re.M):
            scripts.append((rules.parent / name).resolve())
    assert scripts, "no rule runs a script through `script:`"
    for script in scripts:
        source = "import sys\n######## snakemake preamble end #########\n" + script.read_text()
        compile(source, str(script), "exec")  # raises SyntaxError for a misplaced __future__ import

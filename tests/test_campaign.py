"""Issue 57 (long campaigns): a campaign records the code and packages it started with, and a changed library or
package set stops the next submission with one line that names the change and how to go on.

The record and the refusal are tested on ``kvcert.campaign`` directly (the present state is this environment's
real one; a start with other versions is this state with values changed, as a ``pip install -U`` or a ``git pull``
would change them), then once through the workflow: ``snakemake --list-rules`` (parses the Snakefile, builds no
DAG) records the start of an opted-in outdir, and after the record is made to say other code, ``snakemake -n``
on that outdir stops at parse with the one line; ``--config campaign=restart`` goes on and keeps the old start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcert import campaign
from kvcert.provenance import code_fingerprint, short
from kvcert.scales import load_scale, scales_folder

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def here() -> dict:
    return campaign.state()


def _torch_moved(record_state: dict) -> dict:
    """The state of an environment whose torch was one version older (everything else equal)."""
    packages = dict(record_state["packages"], torch="2.0.0")
    return {**record_state, "packages": packages, "code_fingerprint": "0" * 64}


def test_state_is_this_environment(here):
    assert here["code_fingerprint"] == code_fingerprint()
    assert here["packages"]["torch"] == __import__("torch").__version__.split("+")[0] or \
        here["packages"]["torch"] == __import__("torch").__version__
    assert "transformers" in here["packages"] and "kvcert" in here["packages"]
    assert len(here["library_fingerprint"]) == 64 and here["library_fingerprint"] != here["code_fingerprint"]


def test_check_names_the_package_that_moved_and_how_to_go_on(here):
    record = {"starts": [_torch_moved(here)]}
    line = campaign.check(record, here, where="the campaign of results/paper/campaign.json")
    assert line is not None and "\n" not in line
    assert f"torch 2.0.0 -> {here['packages']['torch']}" in line
    assert "pip install torch==2.0.0" in line
    assert "library's files changed" not in line  # only a package moved
    assert "every cell would run again" in line and "--config campaign=restart" in line
    assert campaign.check({"starts": [here]}, here) is None


def test_check_names_a_library_change_with_both_fingerprints_and_the_commit(here):
    old = {**here, "library_fingerprint": "1" * 64, "code_fingerprint": "abcdef0123456789" + "0" * 48,
           "commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False}
    line = campaign.check({"starts": [old]}, here)
    assert "the library's files changed" in line
    assert f"abcdef012345 at the start, {short(here['code_fingerprint'])} now" in line
    assert "git checkout 0123456789ab" in line and "packages changed" not in line


def test_a_package_outside_the_fingerprint_still_stops_the_campaign(here):
    packages = dict(here["packages"])
    packages["numpy"] = "1.0.0"
    packages.pop("pandas", None)
    line = campaign.check({"starts": [{**here, "packages": packages}]}, here)
    assert f"numpy 1.0.0 -> {here['packages']['numpy']}" in line
    if "pandas" in here["packages"]:
        assert f"pandas (none) -> {here['packages']['pandas']}" in line
    assert "pooled with cells of the old packages" in line  # the code fingerprint did not move


def test_ensure_starts_continues_refuses_and_restarts_keeping_the_old_start(tmp_path, here):
    path = tmp_path / "out" / "campaign.json"
    assert campaign.ensure(path, "paper", here=here) == "started"
    first = path.read_text()
    assert campaign.ensure(path, "paper", here=here) == "continued"
    assert path.read_text() == first, "a continued campaign does not rewrite its record"
    record = json.loads(first)
    record["starts"][0] = _torch_moved(record["starts"][0])
    path.write_text(json.dumps(record))
    with pytest.raises(campaign.CampaignChanged, match=f"campaign of {path} started .*torch 2.0.0 -> "):
        campaign.ensure(path, "paper", here=here)
    assert json.loads(path.read_text()) == record, "a refusal writes nothing"
    assert campaign.ensure(path, "paper", restart=True, here=here) == "restarted"
    after = json.loads(path.read_text())
    assert after["starts"][0] == record["starts"][0] and after["starts"][1]["restart_of"] == 0
    assert campaign.ensure(path, "paper", here=here) == "continued"


def test_unreadable_record_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "campaign.json"
    path.write_text("{not json")
    with pytest.raises(campaign.CampaignRecordError, match=f"^{path}: not a readable campaign record"):
        campaign.read(path)
    path.write_text(json.dumps({"starts": []}))
    with pytest.raises(campaign.CampaignRecordError, match=f"^{path}: not a campaign record"):
        campaign.read(path)


def test_campaign_is_on_for_the_paper_scales_and_off_for_the_committed_and_smoke_ones():
    scales = scales_folder(ROOT)
    assert load_scale("paper", scales).get("campaign") is True
    assert load_scale("rehearse", scales).get("campaign") is True  # derived from paper, so inherited
    for name in ("default", "smoke", "v4", "v5-full", "certified-budgets-smoke"):
        assert not load_scale(name, scales).get("campaign"), name


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
                           *args], env=env, capture_output=True, text=True, timeout=300)


def test_workflow_records_the_start_and_refuses_a_changed_library(tmp_path):
    record_path = tmp_path / "results" / "smoke" / "campaign.json"
    start = _snakemake(tmp_path, "--list-rules", "--config", "scale=smoke", "campaign=start")
    assert start.returncode == 0, start.stderr[-2000:]
    assert "kvcert workflow: campaign started: results/smoke/campaign.json" in start.stderr
    record = json.loads(record_path.read_text())
    assert record["scale"] == "smoke" and record["starts"][0]["code_fingerprint"] == code_fingerprint()

    # a git pull: the library's files and so the code fingerprint differ from the start's
    record["starts"][0].update(code_fingerprint="feedbeef0000" + "0" * 52, library_fingerprint="2" * 64)
    record_path.write_text(json.dumps(record))
    refused = _snakemake(tmp_path, "-n", "--config", "scale=smoke")  # the record alone keeps the campaign on
    assert refused.returncode == 1
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("kvcert workflow: error: the campaign of results/smoke/campaign.json started "), last
    assert f"feedbeef0000 at the start, {short(code_fingerprint())} now" in last
    assert "--config campaign=restart" in last
    assert json.loads(record_path.read_text()) == record, "a refusal writes nothing"
    assert not (tmp_path / "results" / "smoke" / "v1").exists() and not list((tmp_path / "results").rglob("*.parquet"))

    restart = _snakemake(tmp_path, "--list-rules", "--config", "scale=smoke", "campaign=restart")
    assert restart.returncode == 0, restart.stderr[-2000:]
    assert "kvcert workflow: campaign restarted" in restart.stderr
    starts = json.loads(record_path.read_text())["starts"]
    assert len(starts) == 2 and starts[0] == record["starts"][0] and starts[1]["code_fingerprint"] == code_fingerprint()

"""Lock / verify / render of the pre-registration, on a temporary copy of the repository's files."""

import shutil
from pathlib import Path

import pytest

from kvcert.analysis import prereg, prereg_cli
from kvcert.analysis.errors import PreregistrationError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def repo(tmp_path):
    """A copy of preregistration/ and the frozen analysis sources (never the repository itself)."""
    shutil.copytree(ROOT / "preregistration", tmp_path / "preregistration",
                    ignore=shutil.ignore_patterns("prereg.lock"))
    shutil.copytree(ROOT / "src" / "kvcert" / "analysis", tmp_path / "src" / "kvcert" / "analysis",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_committed_preregistration_md_equals_the_render():
    doc = prereg.load_claims(ROOT)
    assert (ROOT / prereg.RENDERED_FILE).read_text() == prereg.render(doc)


def test_claims_yaml_has_the_seven_claims_with_frozen_rules():
    doc = prereg.load_claims(ROOT)
    assert [c["id"] for c in doc["claims"]] == [f"c{i}" for i in range(1, 8)]
    for c in doc["claims"]:
        assert c["test"]["n_boot"] >= doc["conventions"]["n_boot"] and "seed" in c["test"]  # "never fewer"
        assert c["paper_verdict"] in ("supported", "not supported")


def test_lock_then_verify_passes(repo):
    prereg.write_lock(repo)
    prereg.verify_lock(repo)
    lock = prereg.read_lock(repo)
    assert lock["files"] == list(prereg.version(1, repo).files) and "locked_at_utc" in lock


def test_verify_refuses_after_an_edited_threshold(repo, capsys):
    prereg.write_lock(repo)
    claims = repo / prereg.CLAIMS_FILE
    claims.write_text(claims.read_text().replace("threshold: 0.65", "threshold: 0.6", 1))
    with pytest.raises(PreregistrationError, match=r"preregistration/claims.yaml changed since the lock"):
        prereg.verify_lock(repo)
    assert prereg_cli.main(["--root", str(repo), "verify"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "preregistration/claims.yaml changed since the lock" in last and "frozen" in last


def test_verify_names_an_edited_analysis_file(repo):
    prereg.write_lock(repo)
    stats = repo / "src/kvcert/analysis/stats.py"
    stats.write_text(stats.read_text() + "\n# edited\n")
    with pytest.raises(PreregistrationError, match=r"src/kvcert/analysis/stats.py changed since the lock"):
        prereg.verify_lock(repo)


def test_missing_lock_is_an_error(repo):
    with pytest.raises(PreregistrationError, match="prereg.lock is missing"):
        prereg.verify_lock(repo)


def test_lock_refuses_to_overwrite(repo):
    prereg.write_lock(repo)
    with pytest.raises(PreregistrationError, match="already exists"):
        prereg.write_lock(repo)
    assert prereg_cli.main(["--root", str(repo), "lock", "--force"]) == 0


def test_render_check_and_find_root(repo, monkeypatch):
    assert prereg_cli.main(["--root", str(repo), "render", "--check"]) == 0
    (repo / prereg.RENDERED_FILE).write_text("edited by hand\n")
    assert prereg_cli.main(["--root", str(repo), "render", "--check"]) == 1
    monkeypatch.chdir(repo / "src" / "kvcert")
    assert prereg.find_root() == repo.resolve()


def test_the_committed_locks_verify_and_the_amendment_render_is_current():
    prereg.verify_lock(ROOT, prereg.latest(ROOT))
    second = prereg.version(2, ROOT)
    assert (ROOT / second.rendered).read_text() == prereg.render_amendment(prereg.load_amendment(ROOT, 2), 2, second.document)


def test_an_amendment_is_locked_on_top_of_version_1_and_verified_with_it(repo):
    shutil.copy(ROOT / "src" / "kvcert" / "analysis" / "amendment2.py", repo / "src" / "kvcert" / "analysis")
    (repo / prereg.version(2, repo).lock).unlink(missing_ok=True)
    with pytest.raises(PreregistrationError, match="prereg.lock is missing"):
        prereg.write_lock(repo, number=2)  # version 1 must be locked first
    prereg.write_lock(repo)
    with pytest.raises(PreregistrationError, match="amendment-2.lock is missing: .*kvcert-prereg lock --amendment 2"):
        prereg.verify_lock(repo, 2)
    prereg.write_lock(repo, number=2)
    prereg.verify_lock(repo, 2)
    with pytest.raises(PreregistrationError, match="amendment-2.lock already exists"):
        prereg.write_lock(repo, number=2)
    pilot = repo / "preregistration" / "amendment-2" / "pilot.csv"
    pilot.write_text(pilot.read_text() + "1,smollm2,retrieval,extra,30,30,1.0,True,False,7.0,1024\n")
    with pytest.raises(PreregistrationError, match="amendment-2/pilot.csv changed since the lock"):
        prereg.verify_lock(repo, 2)
    prereg.verify_lock(repo, 1)  # version 1's record does not depend on the amendment


def test_verify_cli_checks_every_lock(repo, capsys):
    shutil.copy(ROOT / "src" / "kvcert" / "analysis" / "amendment2.py", repo / "src" / "kvcert" / "analysis")
    (repo / prereg.version(2, repo).lock).unlink(missing_ok=True)
    prereg.write_lock(repo)
    assert prereg_cli.main(["--root", str(repo), "verify"]) == 1  # the amendment exists but is not locked
    assert "amendment-2.lock is missing" in capsys.readouterr().err
    prereg.write_lock(repo, number=2)
    assert prereg_cli.main(["--root", str(repo), "verify"]) == 0
    out = capsys.readouterr().out
    assert "version 1 lock OK" in out and "version 2 lock OK" in out

"""Every number names the code that made it: fingerprints, the imported checkout, the kernel build lock,
and a resumed cell that refuses checkpoints of other code (for real: SIGKILL, a library edit, a rerun)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcert import provenance

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "kvcert"


def _copy_package(tmp_path: Path) -> Path:
    target = tmp_path / "pkg" / "kvcert"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_code_fingerprint_follows_library_files_and_nothing_else(tmp_path):
    copy = _copy_package(tmp_path)
    base = provenance.code_fingerprint(copy)
    assert base == provenance.code_fingerprint(PACKAGE)  # independent of where the package lives
    os.utime(copy / "estimator.py", (1, 1))  # file times do not count
    assert provenance.code_fingerprint(copy) == base
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    assert provenance.code_fingerprint(copy) == base
    (copy / "analysis" / "figures.py").write_text((copy / "analysis" / "figures.py").read_text() + "\n# styling\n")
    assert provenance.code_fingerprint(copy) == base  # the analysis has its own fingerprint
    (copy / "conf" / "claim" / "claim.yaml").write_text((copy / "conf" / "claim" / "claim.yaml").read_text() + "\n")
    assert provenance.code_fingerprint(copy) == base
    for edited in ("estimator.py", "kernels/hajek_step.cpp", "conf/run.yaml", "data/assets/longbench.yaml"):
        path = copy / edited
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        assert provenance.code_fingerprint(copy) != base, edited
        path.write_bytes(original)
    assert provenance.code_fingerprint(copy) == base


def test_analysis_fingerprint_follows_the_analysis_and_the_preregistration(tmp_path):
    copy = _copy_package(tmp_path)
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "preregistration", root / "preregistration")
    base = provenance.analysis_fingerprint(root, copy)
    (copy / "estimator.py").write_text((copy / "estimator.py").read_text() + "\n# comment\n")
    assert provenance.analysis_fingerprint(root, copy) == base
    (root / "preregistration" / "claims.yaml").write_text((root / "preregistration" / "claims.yaml").read_text() + "\n")
    changed = provenance.analysis_fingerprint(root, copy)
    assert changed != base
    (copy / "analysis" / "stats.py").write_text((copy / "analysis" / "stats.py").read_text() + "\n")
    assert provenance.analysis_fingerprint(root, copy) not in (base, changed)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_source_checkout_is_that_of_the_imported_package(tmp_path):
    repo = tmp_path / "checkout"
    package = repo / "src" / "kvcert"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.email=t@example.org", "-c", "user.name=t", "add", ".")
    _git(repo, "-c", "user.email=t@example.org", "-c", "user.name=t", "commit", "-qm", "x")
    head = _git(repo, "rev-parse", "HEAD")
    provenance.source_checkout.cache_clear()
    assert provenance.source_checkout(package) == {"commit": head, "dirty": False, "reason": None}
    (repo / "results.csv").write_text("a,b\n")  # results written beside the code do not make it dirty
    provenance.source_checkout.cache_clear()
    assert provenance.source_checkout(package)["dirty"] is False
    (package / "estimator.py").write_text((package / "estimator.py").read_text() + "\n# edit\n")
    provenance.source_checkout.cache_clear()
    assert provenance.source_checkout(package) == {"commit": head, "dirty": True, "reason": None}
    outside = tmp_path / "installed" / "kvcert"
    outside.mkdir(parents=True)
    provenance.source_checkout.cache_clear()
    info = provenance.source_checkout(outside)
    assert info["commit"] is None and info["dirty"] is None and "not inside a git checkout" in info["reason"]
    provenance.source_checkout.cache_clear()


def test_a_stale_build_lock_does_not_hang_the_next_build(tmp_path):
    """A build killed mid-way leaves PyTorch's lock file behind, on which torch's loader waits forever; the
    next build (a fresh extensions directory here, so it really compiles) must remove it and finish, and a
    load of a finished build must not wait on such a file either."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    where = subprocess.run([sys.executable, "-c", "from kvcert import kernels; print(kernels.build_directory())"],
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    build_dir = Path(where)
    (build_dir / "lock").write_text("")  # what a killed build leaves
    proc = subprocess.run([sys.executable, "-m", "kvcert.kernels", "build"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "could not be built" not in proc.stderr
    assert any(build_dir.glob("*.so")) and not (build_dir / "lock").exists()
    (build_dir / "lock").write_text("")
    code = ("import torch; from kvcert import kernels; "
            "p = kernels.attention_path(torch.float32, 'cpu'); print(p.name)")
    load = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert load.returncode == 0 and load.stdout.strip() == "kernel", load.stderr[-2000:]


CELL = ["progress=false", "threads=1", "data=ruler", "data.context_tokens=200", "+data.max_new_tokens=3",
        "n_items=4", "policies=[snapkv]", "designs=[topk,poisson]", "budgets=[0.5]", "seeds=[0]"]


@pytest.mark.smollm2
def test_resume_after_a_library_edit_is_refused(tmp_path):
    """kvcert-run killed after its first checkpointed item, the library edited, the same command rerun: exit 2
    with one line naming both code fingerprints and how to start over; no table is written."""
    copy = _copy_package(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(copy.parent), "TOKENIZERS_PARALLELISM": "false"}
    out_dir = tmp_path / "cell"
    parts = out_dir / ".parts"
    command = [sys.executable, "-m", "kvcert.runner.cli", *CELL, f"out_dir={out_dir}"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(parts.glob("*.items.parquet")):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    old = provenance.code_fingerprint(copy)
    assert json.loads((parts / "identity.json").read_text())["code_fingerprint"] == old
    (copy / "estimator.py").write_text((copy / "estimator.py").read_text() + "\n# a library edit\n")
    new = provenance.code_fingerprint(copy)
    checkpoints = sorted(p.name for p in parts.iterdir())

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    last = rerun.stderr.strip().splitlines()[-1]
    assert rerun.returncode == 2, rerun.stderr[-3000:]
    assert last.startswith("kvcert-run: error: ") and old[:12] in last and new[:12] in last, last
    assert f"delete {parts}" in last
    assert not (out_dir / "items.parquet").exists() and not (out_dir / "steps.parquet").exists()
    assert sorted(p.name for p in parts.iterdir()) == checkpoints  # nothing written, nothing removed

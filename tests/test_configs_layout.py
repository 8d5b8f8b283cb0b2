"""configs/ holds what runs are configured by: the Hydra run configs (configs/run, the package's conf/) and the scale
files (configs/scales). The package finds its configs as a link in a checkout and as files in a built wheel, with
one code fingerprint either way; the paths that locked files name still resolve."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcert import hydra_app, provenance
from kvcert.analysis import cli as claim_cli
from kvcert.scales import SCALES_FOLDER, scale_names, scales_folder

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvcert"
RUN_CONFIGS = ROOT / "configs" / "run"


def _config_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.yaml"))


def test_configs_is_a_folder_of_the_run_configs_and_the_scale_files():
    configs = ROOT / "configs"
    assert configs.is_dir() and not configs.is_symlink()
    for name in ("run.yaml", "calibrate.yaml", "claim/claim.yaml", "data/ruler.yaml", "model/smollm2.yaml"):
        assert (RUN_CONFIGS / name).is_file() and not (RUN_CONFIGS / name).is_symlink(), name
    assert scales_folder(ROOT) == configs / "scales" and not scales_folder(ROOT).is_symlink()
    assert {"default", "smoke", "paper"} <= set(scale_names(scales_folder(ROOT)))
    # The package's conf/ is a relative link to configs/run, so a moved checkout keeps it; the apps compose from it.
    link = PACKAGE / "conf"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve() == RUN_CONFIGS.resolve()
    assert hydra_app.CONF_DIR.resolve() == RUN_CONFIGS.resolve()
    assert claim_cli.CONF_DIR.resolve() == (RUN_CONFIGS / "claim").resolve()
    # The Makefile's folder of scale files is the one kvcert.scales names.
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^SCALES_DIR := (\S+)$", makefile, re.M).group(1) == SCALES_FOLDER.as_posix()
    assert "workflow/scales/*" not in makefile and "workflow/scales/$" not in makefile


def test_paths_that_locked_files_name_still_resolve():
    # Amendments 2 and 3 name scale files under workflow/scales, kept as a link to configs/scales.
    old = ROOT / "workflow" / "scales"
    assert old.is_symlink() and not os.path.isabs(os.readlink(old)) and old.resolve() == scales_folder(ROOT).resolve()
    named = set()
    locked = {f for lock in (ROOT / "preregistration").rglob("*.lock") for f in json.loads(lock.read_text())["files"]}
    for rel in sorted(locked) + [p.relative_to(ROOT).as_posix() for p in (ROOT / "preregistration").glob("*.md")]:
        text = (ROOT / rel).read_text()
        named |= set(re.findall(r"\b((?:workflow|configs|src/kvcert)/[\w/.-]+\.(?:yaml|py))\b", text))
    assert {"workflow/scales/default.yaml", "workflow/scales/v2.yaml"} <= named
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"paths named by locked files that no longer resolve: {missing}"


def test_the_code_fingerprint_hashes_the_run_configs_through_the_link(tmp_path):
    hashed = [p.relative_to(PACKAGE).as_posix()
              for p in provenance._files(PACKAGE, provenance._NOT_CELL_CODE + provenance._NOT_NUMBERS)]
    # every run config but the claim's (the analysis fingerprint's), under the names conf/ gave them before the move
    assert [n for n in hashed if n.startswith("conf/")] == sorted(
        f"conf/{n}" for n in _config_files(RUN_CONFIGS) if not n.startswith("claim/"))
    # A copy with conf/ as a folder (as in a wheel) has the same fingerprints; the claim's config is in the analysis
    # fingerprint only, the run config in the code fingerprint.
    real = tmp_path / "real" / "kvcert"
    shutil.copytree(PACKAGE, real, ignore=shutil.ignore_patterns("__pycache__"))  # conf/ as a folder, as in a wheel
    assert not (real / "conf").is_symlink()
    assert provenance.code_fingerprint(real) == provenance.code_fingerprint(PACKAGE)
    assert provenance.analysis_fingerprint(None, real) == provenance.analysis_fingerprint(None, PACKAGE)
    claim = real / "conf" / "claim" / "claim.yaml"
    claim.write_text(claim.read_text() + "\n")
    assert provenance.analysis_fingerprint(None, real) != provenance.analysis_fingerprint(None, PACKAGE)
    assert provenance.code_fingerprint(real) == provenance.code_fingerprint(PACKAGE)
    run = real / "conf" / "run.yaml"
    run.write_text(run.read_text() + "\n")
    assert provenance.code_fingerprint(real) != provenance.code_fingerprint(PACKAGE)


COMPOSE = """
import sys
from omegaconf import OmegaConf
import kvcert.hydra_app as app
print(app.__file__)
print(OmegaConf.to_yaml(app.compose(["data=longbench", "model=gemma3"])))
"""


@pytest.mark.slow
def test_a_built_wheel_ships_the_run_configs_and_composes_from_them(tmp_path):
    # The checkout as a clone holds it: src/ with its conf link, configs/run, the project files; built as pip does.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src" / "kvcert", source / "src" / "kvcert", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(RUN_CONFIGS, source / "configs" / "run")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("kvcert-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    shipped = sorted(n.removeprefix("kvcert/conf/") for n in names if n.startswith("kvcert/conf/"))
    assert shipped == _config_files(RUN_CONFIGS)  # every run config, as files; no scale file
    assert not any("scales/" in n for n in names)
    installed = tmp_path / "site" / "kvcert"
    assert not (installed / "conf").is_symlink()
    # the installed package's fingerprint is the checkout's, and it composes the same config from its own files
    assert provenance.code_fingerprint(installed) == provenance.code_fingerprint(PACKAGE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    there = subprocess.run([sys.executable, "-c", COMPOSE], env=env, capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    here = subprocess.run([sys.executable, "-c", COMPOSE], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert there.returncode == 0 and here.returncode == 0, there.stderr[-2000:] + here.stderr[-2000:]
    assert there.stdout.splitlines()[0] == str(installed / "hydra_app.py")
    assert there.stdout.splitlines()[1:] == here.stdout.splitlines()[1:] and "gemma" in there.stdout


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@example.org", "-c", "user.name=t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_an_edited_run_config_makes_the_checkout_dirty(tmp_path):
    # A checkout laid out as the repository: the package's conf/ a link to configs/run.
    repo = tmp_path / "checkout"
    package = repo / "src" / "kvcert"
    shutil.copytree(PACKAGE, package, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(RUN_CONFIGS, repo / "configs" / "run")
    (repo / "results").mkdir()
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "x")
    provenance.source_checkout.cache_clear()
    assert provenance.source_checkout(package)["dirty"] is False
    (repo / "results" / "table.csv").write_text("a\n")  # results beside the package do not count
    provenance.source_checkout.cache_clear()
    assert provenance.source_checkout(package)["dirty"] is False
    run = repo / "configs" / "run" / "run.yaml"
    run.write_text(run.read_text() + "\n")
    provenance.source_checkout.cache_clear()
    try:
        assert provenance.source_checkout(package)["dirty"] is True
    finally:
        provenance.source_checkout.cache_clear()

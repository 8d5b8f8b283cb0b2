"""The SLURM profiles name only rules the DAG has, and Snakemake resolves the real profile's resources
(account, partitions, GPUs per cell) from the KVCERT_SLURM_* variables as README documents them.

Dry runs only: nothing is submitted, and no SLURM installation is needed.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvcert.scales import scales_folder

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROFILES = ROOT / "workflow" / "profiles"
NETWORK_OR_TRIVIAL = {"fetch_model", "fetch_longbench", "verify_preregistration"}


def _snakemake(*args, env_extra=None, timeout=300):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in list(env):
        if key.startswith(("KVCERT_SLURM_", "SBATCH_")):
            del env[key]
    env.update(env_extra or {})
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@functools.lru_cache(maxsize=None)
def _dag_rules() -> frozenset[str]:
    """The DAG's rules, from one `snakemake --list-rules` per session."""
    proc = _snakemake("--list-rules")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return frozenset(line.strip() for line in proc.stdout.splitlines() if re.fullmatch(r"\s*\w+\s*", line))


def _load(profile: str) -> dict:
    return yaml.safe_load((PROFILES / profile / "config.yaml").read_text())


def _named_rules(profile: dict) -> set[str]:
    return set(profile.get("set-resources") or {}) | set(profile.get("groups") or {})


@pytest.mark.parametrize("profile", ["slurm", "slurm-local", "local"])
def test_every_rule_a_profile_names_exists(profile):
    rules = _dag_rules()
    assert {"cell", "claim", "aggregate", "notebook_claims", "notebook_certificates"} <= rules
    named = _named_rules(_load(profile))
    assert named <= rules, f"{profile} names rules the DAG does not have: {sorted(named - rules)}"


def test_local_rules_are_not_grouped_or_sized_for_the_cluster():
    """fetch_model / fetch_longbench need the network, verify_preregistration is a hash check: all three
    run where snakemake runs, so the profile has nothing to say about them."""
    text = "\n".join(p.read_text() for p in (ROOT / "workflow" / "rules").glob("*.smk"))
    blocks = re.findall(r"^localrules:\n((?:    \w+,?\n)+)", text, flags=re.M)
    local = {name.strip(" ,") for block in blocks for name in block.split("\n") if name.strip()}
    assert local == NETWORK_OR_TRIVIAL
    profile = _load("slurm")
    assert not (_named_rules(profile) & local)
    assert set(profile["groups"].values()) == set(profile["group-components"])


def _resources_by_rule(output: str) -> dict[str, list[dict[str, str]]]:
    """rule -> resources of each of its jobs, from a dry run's job listing."""
    out: dict[str, list[dict[str, str]]] = {}
    rule = None
    for line in output.splitlines():
        match = re.match(r"^(?:local)?rule (\w+):$", line.strip())
        if match:
            rule = match.group(1)
        elif rule and line.strip().startswith("resources:"):
            pairs = re.findall(r"(\w+)=([^,]+)", line.split("resources:", 1)[1])
            out.setdefault(rule, []).append({k: v.strip() for k, v in pairs})
            rule = None
    return out


SITE = {"KVCERT_SLURM_ACCOUNT": "acct1", "KVCERT_SLURM_PARTITION": "cpu1", "KVCERT_SLURM_GPU_PARTITION": "gpu1"}


# A paper-scale dry run each, so make test-full (make test resolves the profile on the smoke scale:
# test_partition_and_account_fall_back_to_sbatch_variables).
@pytest.mark.slow
@pytest.mark.parametrize("gpus", ["2", "0", None])
def test_the_profile_resolves_site_settings_and_gpus_per_cell(gpus):
    env = dict(SITE, **({"KVCERT_SLURM_CELL_GPUS": gpus} if gpus is not None else {}))
    proc = _snakemake("-n", "--workflow-profile", str(PROFILES / "slurm"), "--config", "scale=paper",
                      "outdir=results/dryrun-profile", env_extra=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = _resources_by_rule(proc.stdout + proc.stderr)
    expected_gpus = gpus if gpus is not None else "1"  # the documented default
    assert len(jobs["cell"]) == 232  # study paper: 27 cells (9 defended) x 8 shards; exploratory leaderboard: 4 x 4
    for res in jobs["cell"]:
        assert res["gpu"] == expected_gpus  # not clamped by the per-submission limit
        assert res["slurm_partition"] == "gpu1" and res["slurm_account"] == "acct1"
        assert res["mem_mb"] == str(yaml.safe_load((scales_folder(ROOT) / "paper.yaml").read_text())
                                    ["resources"]["cell"]["mem_mb"])  # the scale sizes cells
    for rule in ("claim", "aggregate", "notebook_claims", "notebook_certificates"):
        for res in jobs[rule]:
            assert res["slurm_partition"] == "cpu1" and res["slurm_account"] == "acct1"
            assert res.get("gpu", "0") == "0"


def test_partition_and_account_fall_back_to_sbatch_variables():
    proc = _snakemake("-n", "--workflow-profile", str(PROFILES / "slurm"), "--config", "scale=smoke",
                      "outdir=results/dryrun-profile",
                      env_extra={"SBATCH_ACCOUNT": "acct2", "SBATCH_PARTITION": "part2", "KVCERT_SLURM_CELL_GPUS": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = _resources_by_rule(proc.stdout + proc.stderr)
    for rule in ("cell", "claim"):
        for res in jobs[rule]:
            assert res["slurm_partition"] == "part2" and res["slurm_account"] == "acct2"
    assert all(res["gpu"] == "0" for res in jobs["cell"])

"""What every test process needs before anything imports torch, and the fixtures the whole session shares.

Shared once per session, because building them is the suite's most repeated cost:

* ``smollm2``: the bundled SmolLM2-135M-Instruct and its tokenizer, loaded once (float32 on the CPU, eval mode).
  Tests must leave it as they found it (kvcert restores its attention after every call; a test that needs its
  own copy deep-copies it).
* ``scale_dag``: the jobs per rule of a scale's DAG, from one ``snakemake --dry-run --forceall --quiet rules``
  per scale and session (``kvcert.plan.plan_jobs``, the same dry run kvcert-plan reads).
* ``fresh_dry_run``: what ``snakemake --dry-run`` of a scale into a fresh output folder
  (``results/dryrun-<scale>``, which no test creates) prints, jobs and job stats, once per scale and session.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The Triton kernel's tests (test_kernels_triton.py) run it in Triton's interpreter on the CPU. Triton reads
# TRITON_INTERPRET when it is imported, and torch imports it early (torch._dynamo checks for the package), so
# it is set here, before any test module is collected. Nothing else in the suite uses Triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the bundled SmolLM2, loaded once per session."""
    import kvcert

    return kvcert.load_model("smollm2")


@pytest.fixture(scope="session")
def scale_dag():
    """scale_dag(name) -> {rule: jobs} of scale ``name``'s whole DAG (every job forced), built once per scale."""
    from kvcert.plan import plan_jobs

    built = functools.lru_cache(maxsize=None)(lambda name: plan_jobs(name, ROOT))
    return lambda name: dict(built(name))


@pytest.fixture(scope="session")
def fresh_dry_run():
    """fresh_dry_run(name) -> the CompletedProcess of ``snakemake -n --config scale=<name>
    outdir=results/dryrun-<name>`` run in the repository (nothing exists there, so every job is listed with its
    paths), once per scale and session."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    @functools.lru_cache(maxsize=None)
    def run(name):
        return subprocess.run([str(bin_dir / "snakemake"), "-n", "--config", f"scale={name}",
                               f"outdir=results/dryrun-{name}"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
    return run

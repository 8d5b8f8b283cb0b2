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
    (copy / "scales.py").write_text((copy / "scales.py").read_text() + "\n# which cells, not their numbers\n")
    assert provenance.code_fingerprint(copy) == base  # a cell reruns when its overrides change, not the reader
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


@pytest.mark.slow  # compiles the kernel from scratch: make test-full
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


@pytest.mark.slow  # two real cells, one on an edited copy of the library: make test-full
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


# /proc/cpuinfo's first processor, as _cpuinfo reads it, on two x86 CPUs and one ARM CPU (flags shortened).
EPYC = {"model name": "AMD EPYC 7763 64-Core Processor",
        "flags": "fpu sse sse2 pni ssse3 fma sse4_1 sse4_2 avx f16c hypervisor smep avx2 sse4a sha_ni"}
XEON = {"model name": "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz",
        "flags": "fpu sse sse2 pni ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512bw avx512_vnni smep"}
GRAVITON = {"CPU implementer": "0x41", "CPU part": "0xd40", "Features": "fp asimd evtstrm aes sve bf16 i8mm"}


def test_cpu_model_and_isa_are_read_from_cpuinfo():
    assert provenance.cpu_model(EPYC) == "AMD EPYC 7763 64-Core Processor"
    assert provenance.cpu_model(GRAVITON) == "implementer 0x41 part 0xd40"
    # only vector and floating-point instruction sets: fpu, hypervisor, smep, sha_ni round nothing
    assert provenance.cpu_isa(EPYC) == "avx avx2 f16c fma pni sse sse2 sse4_1 sse4_2 sse4a ssse3"
    assert provenance.cpu_isa(XEON).split()[:6] == ["avx", "avx2", "avx512_vnni", "avx512bw", "avx512f", "f16c"]
    assert provenance.cpu_isa(GRAVITON) == "asimd bf16 fp i8mm sve"
    assert provenance.cpu_isa({}) == "unknown"


def test_this_machines_platform_states_every_component():
    here = provenance.numeric_platform()
    assert tuple(here) == provenance.PLATFORM_COMPONENTS
    assert all(isinstance(v, str) and v for v in here.values()), here
    here["cpu_model"] = "edited"  # a copy: the cached platform stays as measured
    assert provenance.numeric_platform()["cpu_model"] != "edited"
    assert provenance.platform_differences(provenance.numeric_platform(), provenance.numeric_platform()) == []


def _platform(cpuinfo: dict, **changes) -> dict:
    return {"machine": "x86_64", "cpu_model": provenance.cpu_model(cpuinfo), "cpu_isa": provenance.cpu_isa(cpuinfo),
            "compiler": "c++ (Debian 12.2.0-14+deb12u1) 12.2.0", "cpu_capability": "AVX2",
            "torch": "2.13.0+cpu", "transformers": "5.24.0", **changes}


def test_platform_differences_name_each_differing_or_missing_component():
    epyc = _platform(EPYC)
    assert provenance.platform_differences(dict(epyc), epyc) == []
    # another CPU model of the same capability (the gap the coarse platform left): not the same platform
    other_model = _platform(EPYC, cpu_model="AMD EPYC 9654 96-Core Processor")
    assert provenance.platform_differences(other_model, epyc) == [
        "cpu_model: 'AMD EPYC 9654 96-Core Processor' in the record, 'AMD EPYC 7763 64-Core Processor' here"]
    xeon = _platform(XEON, cpu_capability="AVX512")
    assert [line.split(":")[0] for line in provenance.platform_differences(xeon, epyc)] == [
        "cpu_model", "cpu_isa", "cpu_capability"]
    assert provenance.platform_differences(_platform(EPYC, compiler="c++ 13.2.0"), epyc)[0].startswith("compiler:")
    # a record of the old, coarse platform (every committed manifest): equal where it says something, yet
    # never proven the same platform
    coarse = {"cpu_capability": "AVX2", "torch": "2.13.0+cpu", "transformers": "5.24.0"}
    assert provenance.platform_differences(coarse, epyc) == [
        "machine: not recorded (here 'x86_64')",
        "cpu_model: not recorded (here 'AMD EPYC 7763 64-Core Processor')",
        f"cpu_isa: not recorded (here {epyc['cpu_isa']!r})",
        "compiler: not recorded (here 'c++ (Debian 12.2.0-14+deb12u1) 12.2.0')"]
    assert provenance.platform_differences(None, epyc) == ["the record states no numeric platform"]

"""Which code made a number: fingerprints of the code and of the checkout it was imported from.

- ``code_fingerprint()``: sha256 over the code that decides a cell's numbers: every file of the installed
  ``kvcert`` package except the analysis package and the scale files' reader (modules, the kernel source,
  the run configs of ``conf/``, data assets), plus
  the versions of torch and transformers. A cell records it; a resumed cell refuses checkpoints of another;
  the workflow reruns a cell when it changes.
- ``analysis_fingerprint(root)``: sha256 over the analysis package, its config and the pre-registration
  files (the frozen thresholds and the code that applies them); the workflow reruns claims when it changes.
- ``source_checkout()``: the git commit of the repository that holds the imported package (not of the
  working directory), and whether that package's files differ from the commit; None with a reason when
  the package is not inside a git checkout.
- ``numeric_platform()``: what decides float rounding besides the code (CPU model and vector instruction
  sets, compiler, torch's CPU capability, torch and transformers); ``platform_differences(record, here)``
  says why two platforms are not proven equal (a component differs or the record lacks it).

Imports nothing heavy at import time (numeric_platform imports torch when called), so the workflow can
compute fingerprints while it parses.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# Parts of the package that decide no cell's numbers: the analysis and its config (their own fingerprint) ...
_NOT_CELL_CODE = ("analysis", "conf/claim")
# ... and the scale files' reader, which decides which cells a scale runs and with which overrides: the workflow
# reruns a cell when its overrides change (the cell rule's own parameters), not when the reader's code does.
# The campaign record (which code a long run started with) decides no numbers either.
_NOT_NUMBERS = ("scales.py", "campaign.py")
_SKIP_DIRS = ("__pycache__",)
_SKIP_SUFFIXES = (".pyc", ".pyo", ".so")
# Versions that change numbers without a change of our code.
_RUNTIME = ("torch", "transformers")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _walk(root: Path) -> list[Path]:
    """Every path under ``root``, through symbolic links to folders: the package's ``conf`` is a link to the
    repository's ``configs/run`` in a checkout and a folder in a built wheel, and both hash the same files."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        found += [Path(folder) / name for name in (*dirs, *files)]
    return found


def _files(root: Path, exclude: tuple[str, ...] = ()) -> list[Path]:
    """Files under ``root`` in a stable order, without caches and hidden files and outside the ``exclude``d
    sub-paths (relative, e.g. "conf/claim")."""
    out = []
    for path in sorted(_walk(root)):
        rel = path.relative_to(root).parts
        if not path.is_file() or any(p in _SKIP_DIRS for p in rel):
            continue
        if any(rel[: len(e.split("/"))] == tuple(e.split("/")) for e in exclude):
            continue
        if path.suffix in _SKIP_SUFFIXES or path.name.startswith("."):
            continue
        out.append(path)
    return out


def _digest(entries: list[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for name, content in entries:
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def code_fingerprint(package: Path = PACKAGE) -> str:
    """sha256 (hex) of the cell code: the package's files except ``analysis/``, plus torch and transformers
    versions. Independent of where the package lives and of file times."""
    entries = [(p.relative_to(package).as_posix(), p.read_bytes())
               for p in _files(package, _NOT_CELL_CODE + _NOT_NUMBERS)]
    entries += [(f"version:{name}", _version(name).encode()) for name in _RUNTIME]
    return _digest(entries)


def analysis_fingerprint(root: str | Path | None = None, package: Path = PACKAGE) -> str:
    """sha256 (hex) of the analysis package and of ``<root>/preregistration/`` (claims, amendments, locks)."""
    entries = [(p.relative_to(package).as_posix(), p.read_bytes())
                for part in _NOT_CELL_CODE for p in _files(package / part)]
    if root is not None and (Path(root) / "preregistration").is_dir():
        prereg = Path(root) / "preregistration"
        entries += [(f"preregistration/{p.relative_to(prereg).as_posix()}", p.read_bytes()) for p in _files(prereg)]
    return _digest(entries)


@lru_cache(maxsize=4)
def source_checkout(package: Path = PACKAGE) -> dict:
    """{"commit", "dirty", "reason"} of the git checkout holding ``package``.

    dirty: whether the package's own files (tracked or not, its linked run configs included) differ from the
    commit; results written into the same checkout do not count. commit and dirty are None, with the reason,
    outside a checkout.
    """
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None,
                    "reason": f"the imported package ({package.name}) is not inside a git checkout"}
        # the package's files, and the run configs its ``conf`` links to in a checkout (configs/run)
        linked = [str((package / "conf").resolve())] if (package / "conf").is_symlink() else []
        status = git("status", "--porcelain", "--untracked-files=normal", "--", ".", *linked)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"commit": None, "dirty": None, "reason": f"git unavailable ({type(err).__name__})"}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()), "reason": None}


# The CPU flags that name vector and floating-point instruction sets: what the compiled kernel's
# -march=native/-mcpu=native and the CPU dispatch of torch, MKL and oneDNN choose code paths by. Other flags
# (virtualisation, power management, security mitigations) round nothing, and a hypervisor shows or hides
# them by its own configuration. Per field of /proc/cpuinfo: x86's "flags" ("pni" is SSE3), ARM's "Features".
_ISA_PREFIXES = {"flags": ("sse", "ssse", "pni", "avx", "fma", "f16c", "amx", "xop"),
                 "Features": ("fp", "asimd", "sve", "sme", "bf16", "i8mm")}
# The components of a numeric platform, in the order messages list them.
PLATFORM_COMPONENTS = ("machine", "cpu_model", "cpu_isa", "compiler", "cpu_capability", "torch", "transformers")


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none: not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model(cpuinfo: dict[str, str] | None = None) -> str:
    """The CPU's model name ("AMD EPYC 7763 64-Core Processor"; ARM: implementer and part), else
    platform.processor(), else "unknown"."""
    import platform

    info = _cpuinfo() if cpuinfo is None else cpuinfo
    if info.get("model name"):
        return info["model name"]
    if info.get("CPU implementer") or info.get("CPU part"):
        return f"implementer {info.get('CPU implementer', '?')} part {info.get('CPU part', '?')}"
    return platform.processor() or "unknown"


def cpu_isa(cpuinfo: dict[str, str] | None = None) -> str:
    """The vector and floating-point instruction sets the CPU reports, sorted and space-separated
    ("avx avx2 f16c fma pni sse sse2 ..."), or "unknown" where /proc/cpuinfo states no flags."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    found = sorted({flag for field, prefixes in _ISA_PREFIXES.items()
                    for flag in info.get(field, "").split() if flag.startswith(prefixes)})
    return " ".join(found) if found else "unknown"


def compiler() -> str:
    """The first line of ``$CXX --version`` (``c++`` without CXX: the compiler torch builds extensions with),
    or "none" where it does not run. The kernel's code for one instruction set still differs by compiler."""
    import os

    command = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    first = done.stdout.strip().splitlines()[:1]
    return first[0] if done.returncode == 0 and first else "none"


def numeric_platform() -> dict:
    """What decides float rounding besides the code: the machine, the CPU model and its vector instruction sets
    (the compiled kernel is built with -march=native; torch, MKL and oneDNN dispatch by CPU), the compiler
    that builds the kernel, the instruction set torch dispatches its own kernels to, and the torch and
    transformers versions. Keys: PLATFORM_COMPONENTS. Two runs on equal platforms give equal bytes."""
    return dict(_numeric_platform())


@lru_cache(maxsize=1)
def _numeric_platform() -> tuple[tuple[str, str], ...]:
    import platform

    import torch

    return (("machine", platform.machine()), ("cpu_model", cpu_model()), ("cpu_isa", cpu_isa()),
            ("compiler", compiler()), ("cpu_capability", torch.backends.cpu.get_cpu_capability()),
            ("torch", torch.__version__), ("transformers", _version("transformers")))


def platform_differences(record: dict | None, here: dict) -> list[str]:
    """Why ``here`` is not proven to be the platform ``record`` was made on: one line per component of
    PLATFORM_COMPONENTS that the record lacks or states otherwise (empty: the same platform, bytes must agree).

    record: a numeric platform as a manifest or platform.json states it (None: none stated); here:
    ``numeric_platform()`` of the recomputing machine. A record that states fewer components (written before
    they were recorded) cannot be proven the same platform."""
    if record is None:
        return ["the record states no numeric platform"]
    out = []
    for key in PLATFORM_COMPONENTS:
        if record.get(key) is None:
            out.append(f"{key}: not recorded (here {here.get(key)!r})")
        elif record[key] != here.get(key):
            out.append(f"{key}: {record[key]!r} in the record, {here.get(key)!r} here")
    return out


def short(fingerprint: str | None) -> str:
    """The first 12 hex digits (what messages show)."""
    return (fingerprint or "unknown")[:12]


__all__ = ["PLATFORM_COMPONENTS", "analysis_fingerprint", "code_fingerprint", "compiler", "cpu_isa", "cpu_model",
           "numeric_platform", "platform_differences", "sha256_file", "short", "source_checkout"]

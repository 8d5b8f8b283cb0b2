"""Fused kernels of certified attention: the compiled CPU one, built once per machine by the install step and
loaded where it applies, and an experimental Triton one for CUDA.

``hajek_step`` fuses one certified attention call: the Hájek output and the per-coordinate linearized
variance in one pass over the keys and values (``hajek_step.cpp`` states the contract, docs/METHOD.md §4).
It is an optional accelerator of ``kvcert.estimator``, which stays the reference and runs wherever the
kernel does not apply. ``hajek_triton`` is the same call for CUDA in Triton, used only when
``KVCERT_TRITON=1`` (it has not run on a GPU yet: its tests run it in Triton's interpreter,
``TRITON_INTERPRET=1``, where the same setting also selects it on the CPU). ``attention_path(dtype, device)``
says which implementation certified attention uses and why: the compiled kernel only for float32 on the CPU,
never for GPUs or other dtypes (it is then never built), and not with ``KVCERT_KERNELS=0`` or where no
compiler is found.

Building: ``python -m kvcert.kernels build`` (``make install`` runs it) compiles into PyTorch's extension
directory (``TORCH_EXTENSIONS_DIR``) under a name that hashes the source, the flags, the torch version and
the CPU, so machines sharing a home directory never load each other's build. A built library is loaded
directly. A missing one is built on first use under an exclusive ``flock`` (released by the kernel if the
builder dies), so parallel jobs never compile at once, and a lock file left behind by a killed build is
removed instead of waited on forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

SOURCE = Path(__file__).with_name("hajek_step.cpp")
DISABLE_ENV = "KVCERT_KERNELS"
TRITON_ENV = "KVCERT_TRITON"


@dataclass(frozen=True)
class AttentionPath:
    """Which implementation certified attention runs: ``kernel`` (the compiled op) or ``pytorch``
    (``kvcert.estimator``), and why not the kernel (empty for the kernel). The two differ only in
    float32 rounding."""

    name: str
    reason: str = ""
    op: Callable | None = field(default=None, compare=False, repr=False)
    # (head_dim, value_dim) -> whether ``op`` handles them; None: any
    handles: Callable[[int, int], bool] | None = field(default=None, compare=False, repr=False)

    def accepts(self, head_dim: int, value_dim: int) -> bool:
        """Whether ``op`` computes a call with these head sizes (else the call takes the PyTorch path)."""
        return self.op is not None and (self.handles is None or self.handles(head_dim, value_dim))

    def as_dict(self) -> dict[str, str]:
        return {"path": self.name, "reason": self.reason}


def _cpu_signature() -> str:
    """The CPU's model and feature flags (the build targets this CPU's instruction set)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return platform.machine() + line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _flags() -> list[str]:
    arch = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else ["-mcpu=native"]
    return ["-O3", "-fopenmp", *arch]


def build_name() -> str:
    """The extension's name: hashes the source, flags, torch version and CPU (a build links against them).

    The source's path is in the key too: a build file names it, so two checkouts sharing one extension
    directory would otherwise rebuild each other's kernel on every start."""
    key = " ".join([*_flags(), torch.__version__, _cpu_signature(), str(SOURCE.resolve())])
    return f"kvcert_kernels_{hashlib.sha256(SOURCE.read_bytes() + key.encode()).hexdigest()[:16]}"


def build_directory() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(build_name(), verbose=False))


def library_path() -> Path:
    return build_directory() / f"{build_name()}.so"


def build(quiet: bool = False) -> Path:
    """Compile the kernel library if it is not built yet; returns its path. Raises on a failed build.

    Holds an exclusive flock beside the build directory while building, so concurrent callers wait for one
    build instead of compiling at once. PyTorch's own lock file (``<build dir>/lock``) is waited on forever
    if a killed build left it behind; under our flock no other kvcert build can be running, so a leftover
    one is stale and is removed.
    """
    from torch.utils.cpp_extension import load

    directory = build_directory()
    target = directory / f"{build_name()}.so"
    with open(directory.parent / f".{directory.name}.kvcert-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        (directory / "lock").unlink(missing_ok=True)
        if not quiet:
            print(f"kvcert: compiling {SOURCE.name} for this CPU (once, about 20 s)", file=sys.stderr, flush=True)
        load(name=build_name(), sources=[str(SOURCE)], extra_cflags=_flags(), extra_ldflags=["-fopenmp"],
             build_directory=str(directory), is_python_module=False, verbose=False)
    return target


@lru_cache(maxsize=1)
def _load() -> tuple[Callable | None, str]:
    """(``torch.ops.kvcert.hajek_step`` or None, why not). Builds on first use if needed."""
    if hasattr(torch.ops.kvcert, "hajek_step"):
        return torch.ops.kvcert.hajek_step, ""
    try:
        path = library_path()
        if not path.exists():
            path = build()  # loads it too
        if not hasattr(torch.ops.kvcert, "hajek_step"):
            torch.ops.load_library(str(path))
    except Exception as err:  # noqa: BLE001 - no compiler, no ninja, unsupported flags: the PyTorch path still works
        reason = f"build failed ({type(err).__name__}: {' '.join(str(err).split())[:300]})"
        print(f"kvcert: compiling {SOURCE.name} failed; certified attention uses the PyTorch path: {reason}",
              file=sys.stderr, flush=True)
        return None, reason
    return torch.ops.kvcert.hajek_step, ""


@lru_cache(maxsize=1)
def _load_triton() -> tuple[Callable | None, str]:
    """(the Triton ``hajek_step`` or None, why not)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None, f"{TRITON_ENV}=1, but triton is not installed"
    from .hajek_triton import hajek_step

    return hajek_step, ""


def attention_path(dtype: torch.dtype, device: torch.device | str) -> AttentionPath:
    """The certified-attention implementation for a model of ``dtype`` on ``device``, with the reason.

    Loads (or, once, builds) the kernel only when it applies: float32 on the CPU, kernels not disabled; the
    Triton kernel instead with ``KVCERT_TRITON=1`` on CUDA (or on the CPU under ``TRITON_INTERPRET=1``).
    """
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return AttentionPath("pytorch", f"disabled by {DISABLE_ENV}=0")
    kind = torch.device(device).type
    if os.environ.get(TRITON_ENV) == "1" and (kind == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        from .hajek_triton import supports

        op, reason = _load_triton()
        return AttentionPath("triton", "", op, supports) if op is not None else AttentionPath("pytorch", reason)
    if kind != "cpu":
        return AttentionPath("pytorch", f"device {kind}: the compiled kernel is CPU-only")
    if dtype != torch.float32:
        return AttentionPath("pytorch", f"dtype {str(dtype).removeprefix('torch.')}: the compiled kernel is float32-only")
    op, reason = _load()
    if op is None:
        return AttentionPath("pytorch", reason)
    return AttentionPath("kernel", "", op)


def hajek_step_op() -> Callable | None:
    """``torch.ops.kvcert.hajek_step`` (built or loaded on first call), or None when disabled or unbuildable."""
    return attention_path(torch.float32, "cpu").op


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcert.kernels build``: compile the kernel now (the install step), or report why not."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["build"]:
        print("usage: python -m kvcert.kernels build", file=sys.stderr)
        return 2
    try:
        print(f"kvcert: kernel library {build()}")
    except Exception as err:  # noqa: BLE001 - a machine without a compiler still runs (PyTorch path)
        print(f"kvcert: warning: the compiled kernel could not be built ({type(err).__name__}: "
              f"{' '.join(str(err).split())[:300]}); certified attention will use the PyTorch path", file=sys.stderr)
    return 0


__all__ = ["DISABLE_ENV", "AttentionPath", "attention_path", "build", "hajek_step_op", "library_path"]

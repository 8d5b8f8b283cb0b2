"""Compiled CPU kernels, built once on first use with the machine's C++ compiler.

``hajek_step`` fuses one certified attention call: the Hájek output and the per-coordinate linearized
variance in one pass over the keys and values (``hajek_step.cpp`` states the contract). It is an
optional accelerator of ``kvcert.estimator``, which stays the reference: where no compiler is found, or
with ``KVCERT_KERNELS=0``, ``hajek_step_op()`` returns None and callers use the PyTorch path.
The build goes to PyTorch's extension directory (``TORCH_EXTENSIONS_DIR``), under a name that hashes the
source, its path, the flags, the torch version and the CPU, so that machines (or checkouts) sharing a
home directory never load or rebuild each other's build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("hajek_step.cpp")
DISABLE_ENV = "KVCERT_KERNELS"


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


@lru_cache(maxsize=1)
def hajek_step_op():
    """``torch.ops.kvcert.hajek_step``, compiled on first call; None when disabled or the build fails."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if not hasattr(torch.ops.kvcert, "hajek_step"):
        from torch.utils.cpp_extension import _get_build_directory, load

        flags = _flags()
        # A build links against this torch; its build file names the source's path, so two checkouts
        # sharing one extension directory would otherwise rebuild each other's kernel on every start.
        key = " ".join([*flags, torch.__version__, _cpu_signature(), str(SOURCE.resolve())])
        digest = hashlib.sha256(SOURCE.read_bytes() + key.encode())
        name = f"kvcert_kernels_{digest.hexdigest()[:16]}"
        try:
            if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists():
                print(f"kvcert: compiling {SOURCE.name} for this CPU (once, about 20 s)", file=sys.stderr, flush=True)
            load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 is_python_module=False, verbose=False)
        except Exception as err:  # no compiler, no ninja, unsupported flags: the PyTorch path still works
            warnings.warn(f"kvcert: compiling {SOURCE.name} failed ({type(err).__name__}: {err}); "
                          "certified attention uses the PyTorch path", RuntimeWarning, stacklevel=2)
            return None
    return torch.ops.kvcert.hajek_step


__all__ = ["DISABLE_ENV", "hajek_step_op"]

"""What the Triton kernel of certified attention asks of a GPU, compiled ahead of time on any machine.

For each cache dtype, head size, slots per loop step and warps per program, the kernel is compiled for an NVIDIA
compute capability (``kvcert.kernels.hajek_triton.compile_for``; Triton's compiler and the ptxas of its wheel, no
GPU) and ``cuobjdump`` (also in Triton's wheel) reads registers per thread, stack bytes per thread (registers
spilled to local memory, which a fast kernel avoids) and shared memory per program from the binary. The row of
the shipped configuration is marked. These are the compiler's numbers, not timings: speed needs a GPU.

    python benchmarks/triton_kernel_resources.py [--capability 90]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and stack bytes per thread of the kernel in ``cubin`` (cuobjdump --dump-resource-usage)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        report = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                                check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", report))
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capability", type=int, default=90, help="compute capability: 80 A100, 90 H100/H200")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("triton_kernel_resources: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    import torch

    from kvcert.kernels import hajek_triton

    print(f"sm_{args.capability}: registers and stack bytes per thread, shared bytes per program\n")
    print("| dtype | head size | slots per step | warps | registers | stack bytes | shared bytes | shipped |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for head in (64, 128):
            for slots in (16, 32, 64):
                for warps in (4, 8):
                    compiled = hajek_triton.compile_for(args.capability, dtype, head, block_slots=slots,
                                                        num_warps=warps)
                    use = resource_usage(compiled.asm["cubin"])
                    shipped = slots == hajek_triton.BLOCK_SLOTS and warps == hajek_triton.NUM_WARPS
                    print(f"| {str(dtype).removeprefix('torch.')} | {head} | {slots} | {warps} | {use['registers']} "
                          f"| {use['stack_bytes']} | {compiled.metadata.shared} | {'yes' if shipped else ''} |",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

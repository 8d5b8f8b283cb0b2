"""What every test process needs before anything imports torch."""

import os

# The Triton kernel's tests (test_kernels_triton.py) run it in Triton's interpreter on the CPU. Triton reads
# TRITON_INTERPRET when it is imported, and torch imports it early (torch._dynamo checks for the package), so
# it is set here, before any test module is collected. Nothing else in the suite uses Triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

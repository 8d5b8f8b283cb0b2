"""The Triton kernel of certified attention (``kvcert.kernels.hajek_triton``), run in Triton's interpreter on the
CPU (``TRITON_INTERPRET=1``): against float64 references of the same inputs in the dtypes a GPU uses, against the
compiled CPU kernel, and inside real SmolLM2 decoding against the PyTorch path; and compiled ahead of time for
A100 and H100 by Triton's own compiler (no GPU needed). It has not run on a GPU; these tests hold its arithmetic,
its contract and that it builds for the GPUs the paper scale names, not its speed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import kvcert  # noqa: E402
from kvcert.estimator import hajek_with_variance  # noqa: E402
from kvcert.generation import decode_batch  # noqa: E402
from kvcert.kernels import AttentionPath, attention_path, hajek_step_op, hajek_triton  # noqa: E402


@pytest.fixture()
def interpreted():
    """The kernel as Triton's interpreter runs it (on the CPU)."""
    import triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 was not set when triton was imported (tests/conftest.py)"
    assert os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(b, h, rows, n, t, d, dtype, causal, seed=0):
    """q (b, h, rows, d), k, v (b, h, n, d) in ``dtype``; bias (b, h, 1 or rows, n) float32 (−log π, and −inf above
    the diagonal of the last ``rows`` slots when ``causal``); 1 − π (b, h, t) float32."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, m, d, generator=g) for m in (rows, n))
    v = torch.randn(b, h, n, d, generator=g) + 3.0  # a common offset: what the centring is for
    log_pi = torch.zeros(b, h, n)
    log_pi[..., :t] = torch.rand(b, h, t, generator=g).clamp_min(0.02).log()
    bias = (-log_pi).unsqueeze(-2)
    if causal:
        above = torch.ones(rows, rows, dtype=torch.bool).triu(1)
        bias = bias.expand(b, h, rows, n).clone()
        bias[..., n - rows:] = bias[..., n - rows:].masked_fill(above, float("-inf"))
    return (*(x.to(dtype) for x in (q, k, v)), bias, -torch.expm1(log_pi[..., :t]))


def _reference(q, k, v, bias, one_minus_pi, scale):
    """float64 ``hajek_with_variance`` of the same (already rounded) inputs, shaped (b, h, rows, ·)."""
    b, h = q.shape[:2]
    flat = lambda x: x.reshape(b * h, *x.shape[2:]).double()  # noqa: E731
    out, var, terms = hajek_with_variance(flat(q), flat(k), flat(v), flat(bias), scale, flat(one_minus_pi))
    return (x.reshape(b, h, *x.shape[1:]) for x in (out, var, terms))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n, t, causal", [(3, 150, 100, False), (20, 90, 60, True), (4, 70, 70, False),
                                                 (3, 40, 0, False)])
def test_the_kernel_equals_a_float64_reference(interpreted, dtype, rows, n, t, causal):
    """Decode rows (one bias row for all), multi-token rows with a causal mask, every slot sampled, none sampled;
    in each dtype against float64 of the same rounded inputs: the kernel computes in float32 whatever the cache's
    dtype, so the bounds are float32's (relative to each tensor's largest entry)."""
    q, k, v, bias, one_minus_pi = _inputs(2, 3, rows, n, t, 64, dtype, causal)
    terms = torch.full((2, 3, rows, 2), float("nan"))
    out, var = hajek_triton.hajek_step(q, k, v, bias, one_minus_pi, 0.125, terms)
    assert out.dtype == var.dtype == torch.float32 and out.shape == var.shape == (2, 3, rows, 64)
    ref_out, ref_var, ref_terms = _reference(q, k, v, bias, one_minus_pi, 0.125)
    for got, want in ((out, ref_out), (var, ref_var), (terms, ref_terms)):
        scale = float(want.abs().max())
        assert float((got.double() - want).abs().max()) <= 2e-6 * max(scale, 1e-30), (got, want)
    if t == 0:
        assert (var == 0).all() and (terms == 0).all()


def test_the_kernel_equals_the_compiled_cpu_kernel(interpreted):
    """Both fused implementations of one contract, float32: the same outputs, variances and terms to float32
    rounding (they sum in different orders)."""
    op = hajek_step_op()
    if op is None:
        pytest.skip("the compiled CPU kernel is not available here")
    q, k, v, bias, one_minus_pi = _inputs(1, 3, 9, 300, 220, 64, torch.float32, causal=True, seed=3)
    got_terms, want_terms = torch.empty(1, 3, 9, 2), torch.empty(1, 3, 9, 2)
    got = hajek_triton.hajek_step(q, k, v, bias, one_minus_pi, 0.125, got_terms)
    want = op(q, k, v, bias, one_minus_pi, 0.125, want_terms)
    for a, b in zip((*got, got_terms), (*want, want_terms)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_unsupported_head_sizes_are_refused_and_left_to_the_pytorch_path():
    """Triton's blocks need powers of two from 16: the path says so, and the op refuses others in one line."""
    path = AttentionPath("triton", "", hajek_triton.hajek_step, hajek_triton.supports)
    assert path.accepts(64, 64) and path.accepts(128, 128) and path.accepts(16, 16)
    assert not path.accepts(80, 80) and not path.accepts(64, 96) and not path.accepts(8, 8)
    assert AttentionPath("kernel", "", hajek_triton.hajek_step).accepts(80, 80)
    with pytest.raises(ValueError, match="powers of two"):
        hajek_triton.hajek_step(*_inputs(1, 1, 2, 20, 10, 80, torch.float32, causal=False), 0.1)


@pytest.mark.slow  # a real decode through Triton's CPU interpreter: make test-full
@pytest.mark.smollm2
def test_smollm2_decodes_the_same_through_the_triton_kernel(interpreted, monkeypatch):
    """Real decoding (SmolLM2, certificates and the oracle on, a Poisson row) through the Triton kernel and
    through the PyTorch path it stands in for: the same tokens, and the same step rows to float32 rounding. The
    model runs in float32 so that rounding differences of the two float32 computations are not amplified by a
    bfloat16 model's (the dtypes a GPU uses are the test above's)."""
    from kvcert.theory import passkey_prompt

    model, tokenizer = kvcert.load_model("smollm2")
    context, question, _ = passkey_prompt(n_noise=8, n_needles=2, seed=4)
    ids = kvcert.build_prompt(tokenizer, context, question, setting="streaming", max_new_tokens=3)
    state = kvcert.prefill(model, ids.prefix_ids, ids.suffix_ids, setting="streaming")
    rows = [kvcert.select(state, "snapkv", "poisson", 0.3, seed=1)]

    def run(triton: bool):
        monkeypatch.setenv("KVCERT_TRITON", "1" if triton else "0")
        monkeypatch.setenv("KVCERT_KERNELS", "1" if triton else "0")
        assert attention_path(torch.float32, "cpu").name == ("triton" if triton else "pytorch")
        return decode_batch(model, state, rows, max_new_tokens=3, certify=True, oracle=True)

    fused, reference = run(True), run(False)
    assert [r.attention_path["path"] for r in fused] == ["triton"]
    assert [r.attention_path["path"] for r in reference] == ["pytorch"]
    for got, want in zip(fused, reference):
        assert got.token_ids == want.token_ids
        keys = ["step", "layer", "kv_head"]
        pd.testing.assert_frame_equal(got.steps[keys], want.steps[keys])
        for column in ("trace_var", "true_err", "tail_ess"):  # float32 rounding of each column's scale
            want_column = want.steps[column].to_numpy()
            np.testing.assert_allclose(got.steps[column], want_column, rtol=1e-4, atol=1e-6 * np.abs(want_column).max(),
                                       err_msg=column)


# Shared memory one block may use, by compute capability (CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability": 163 KB on 8.0, 227 KB on 9.0).
MAX_SHARED_BYTES = {80: 163 * 1024, 90: 227 * 1024}

_COMPILE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from kvcert.kernels.hajek_triton import compile_for
from triton_kernel_resources import resource_usage
out = []
for capability, dtype, head in [(80, "bfloat16", 128), (80, "float32", 128), (90, "bfloat16", 128),
                                (90, "float16", 64), (90, "float32", 128)]:
    compiled = compile_for(capability, getattr(torch, dtype), head)
    out.append({"capability": capability, "dtype": dtype, "head": head, "cubin": len(compiled.asm["cubin"]),
                "shared": compiled.metadata.shared, "warps": compiled.metadata.num_warps,
                **resource_usage(compiled.asm["cubin"])})
print(json.dumps(out))
"""


def test_the_kernel_compiles_for_a100_and_h100_within_their_shared_memory():
    """Triton's compiler and ptxas (shipped in its wheel) build the kernel for sm_80 and sm_90 in the cache dtypes
    a GPU uses, at the paper models' head size 128: every launch's shared memory fits the GPU's per-block limit,
    and the binary's registers are read back (benchmarks/triton_kernel_resources.py prints the full grid). Runs
    in a fresh process: this one built the kernel for the interpreter."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(root / "benchmarks")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(builds) == 5
    for build in builds:
        assert build["cubin"] > 10_000 and build["warps"] == hajek_triton.NUM_WARPS, build
        assert 0 < build["shared"] <= MAX_SHARED_BYTES[build["capability"]], build
        assert 0 < build["registers"] <= 255 and build["stack_bytes"] >= 0, build


def test_compile_for_refuses_what_it_cannot_build(interpreted):
    with pytest.raises(ValueError, match=r"d=96, dv=96 must be powers of two"):
        hajek_triton.compile_for(90, torch.bfloat16, 96)
    with pytest.raises(ValueError, match=r"dtype torch.float64 is not one of"):
        hajek_triton.compile_for(90, torch.float64, 128)
    with pytest.raises(RuntimeError, match=r"built for Triton's interpreter"):
        hajek_triton.compile_for(90, torch.bfloat16, 128)

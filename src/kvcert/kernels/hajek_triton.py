"""One certified attention call fused for CUDA in Triton: the GPU counterpart of ``hajek_step.cpp``, same contract.

For every (batch, KV head) and each of its R query rows (the group's query heads × query positions), over n slots
with the additive logit bias b (−log π on retained slots, −inf where not retained or masked):

    a_i = softmax_i(scale · q·k_i + b_i),   out = Σ_i a_i v_i,
    var_j = Σ_{i<t} (1 − π_i) a_i² (v_ij − out_j)²,
    terms = (Σ_{i<t} c_i, Σ_{i<t} c_i²),   c_i = (1 − π_i) a_i²   (terms below the smallest normal float dropped).

One program per (batch·KV head, block of rows): a first loop over the slots computes the output with an online
softmax; a second loop over the first t slots (the only sampled ones) reads their keys and values again and adds
the variance's sums Σc, Σc², Σc(v − μ) and Σc(v − μ)², centred on μ, the mean output of the program's rows
(as ``kvcert.estimator.hajek_with_variance`` does), so that no per-slot tensor leaves the kernel. Everything is
float32 whatever the cache's dtype, with full-precision float32 products (no TF32).

Not yet run on a GPU: the tests run it in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``), against
float64 references, and compile it ahead of time for A100 and H100 (:func:`compile_for`: Triton's compiler and
the ``ptxas`` its wheel ships, no GPU needed). Certified attention uses it on CUDA only when ``KVCERT_TRITON=1``
(``kvcert.kernels``).
"""

from __future__ import annotations

from functools import lru_cache

import torch

# Below this, a term c_i is dropped (the largest subnormal float32), as the CPU kernel and the PyTorch path do.
SMALLEST_KEPT = float(torch.nextafter(torch.tensor(torch.finfo(torch.float32).tiny), torch.tensor(0.0)))
BLOCK_ROWS = 16  # tl.dot needs 16 rows at least; masked rows beyond R cost nothing but registers
# Slots per loop step and warps per program: compiled for sm_90 at head size 128 in bfloat16, 32 slots and 4 warps
# spill 984 bytes of registers per thread to local memory, 16 slots and 8 warps 16 bytes (at 64: none);
# benchmarks/triton_kernel_resources.py prints the grid.
BLOCK_SLOTS = 16
NUM_WARPS = 8


@lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel, built on first use (so that ``TRITON_INTERPRET`` is read when it is needed)."""
    import triton
    import triton.language as tl

    @triton.jit
    def hajek_step_kernel(q_ptr, k_ptr, v_ptr, b_ptr, w_ptr, out_ptr, var_ptr, terms_ptr,
                          rows, n, t, scale, tiny,
                          sq_h, sq_r, sk_h, sk_n, sv_h, sv_n, sb_h, sb_r, sb_n, sw_h, so_h, so_r, st_h, st_r,
                          D: tl.constexpr, DV: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
        h = tl.program_id(0)
        r = tl.program_id(1) * BR + tl.arange(0, BR)
        live = r < rows
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        q = tl.load(q_ptr + h * sq_h + r[:, None] * sq_r + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        top = tl.full((BR,), float("-inf"), tl.float32)
        total = tl.zeros((BR,), tl.float32)
        acc = tl.zeros((BR, DV), tl.float32)
        for start in range(0, n, BN):
            s = start + tl.arange(0, BN)
            inside = s < n
            k = tl.load(k_ptr + h * sk_h + s[:, None] * sk_n + d[None, :], mask=inside[:, None], other=0.0)
            logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            logits += tl.load(b_ptr + h * sb_h + r[:, None] * sb_r + s[None, :] * sb_n,
                              mask=live[:, None] & inside[None, :], other=float("-inf"))
            new_top = tl.maximum(top, tl.max(logits, axis=1))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row with nothing yet: exp(−inf) = 0
            e = tl.exp(logits - shift[:, None])
            rescale = tl.exp(top - shift)
            v = tl.load(v_ptr + h * sv_h + s[:, None] * sv_n + dv[None, :], mask=inside[:, None], other=0.0)
            total = total * rescale + tl.sum(e, axis=1)
            acc = acc * rescale[:, None] + tl.dot(e, v.to(tl.float32), input_precision="ieee")
            top = new_top
        norm = tl.where(total > 0, total, 1.0)
        out = acc / norm[:, None]
        rows_here = tl.maximum(tl.sum(live.to(tl.float32)), 1.0)
        centre = tl.sum(tl.where(live[:, None], out, 0.0), axis=0) / rows_here
        s0 = tl.zeros((BR,), tl.float32)
        s_sq = tl.zeros((BR,), tl.float32)
        s1 = tl.zeros((BR, DV), tl.float32)
        s2 = tl.zeros((BR, DV), tl.float32)
        last = tl.where(top == float("-inf"), 0.0, top)
        for start in range(0, t, BN):
            s = start + tl.arange(0, BN)
            inside = s < t
            k = tl.load(k_ptr + h * sk_h + s[:, None] * sk_n + d[None, :], mask=inside[:, None], other=0.0)
            logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            logits += tl.load(b_ptr + h * sb_h + r[:, None] * sb_r + s[None, :] * sb_n,
                              mask=live[:, None] & inside[None, :], other=float("-inf"))
            a = tl.exp(logits - last[:, None]) / norm[:, None]
            c = a * a * tl.load(w_ptr + h * sw_h + s, mask=inside, other=0.0)[None, :]
            c = tl.where(c > tiny, c, 0.0)
            v = tl.load(v_ptr + h * sv_h + s[:, None] * sv_n + dv[None, :], mask=inside[:, None], other=0.0)
            centred = tl.where(inside[:, None], v.to(tl.float32) - centre[None, :], 0.0)
            s0 += tl.sum(c, axis=1)
            s_sq += tl.sum(c * c, axis=1)
            s1 += tl.dot(c, centred, input_precision="ieee")
            s2 += tl.dot(c, centred * centred, input_precision="ieee")
        offset = out - centre[None, :]
        # Σc(v − ô)² = Σc(v − μ)² − 2(ô − μ)·Σc(v − μ) + (ô − μ)²Σc, per coordinate, clamped at 0
        var = tl.maximum(s2 - 2.0 * offset * (s1 - 0.5 * s0[:, None] * offset), 0.0)
        where = h * so_h + r[:, None] * so_r + dv[None, :]
        tl.store(out_ptr + where, out, mask=live[:, None])
        tl.store(var_ptr + where, var, mask=live[:, None])
        tl.store(terms_ptr + h * st_h + r * st_r, s0, mask=live)
        tl.store(terms_ptr + h * st_h + r * st_r + 1, s_sq, mask=live)

    return hajek_step_kernel


def _power_of_two(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def supports(head_dim: int, value_dim: int) -> bool:
    """Whether the kernel handles these head sizes (powers of two from 16: Triton's blocks)."""
    return _power_of_two(head_dim) and _power_of_two(value_dim)


def hajek_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, one_minus_pi: torch.Tensor,
               scale: float, terms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of ``torch.ops.kvcert.hajek_step`` (``hajek_step.cpp``), on CUDA (or under Triton's interpreter).

    q: (B, H, R, d); k: (B, H, n, d); v: (B, H, n, dv), any float dtype; bias: (B, H, 1 or R, n); one_minus_pi:
    (B, H, t), t ≤ n, 1 − π of the first t slots. Returns out and var, both (B, H, R, dv) float32; terms, when
    given, a float32 (B, H, R, 2) tensor, receives (Σc, Σc²) per row. d and dv must be powers of two ≥ 16.
    """
    b, h, rows, d = q.shape
    n, dv, t = k.shape[-2], v.shape[-1], one_minus_pi.shape[-1]
    if not supports(d, dv):
        raise ValueError(f"hajek_step (Triton): head sizes d={d}, dv={dv} must be powers of two >= 16")
    if k.shape != (b, h, n, d) or v.shape[:-1] != (b, h, n) or bias.shape not in ((b, h, 1, n), (b, h, rows, n)) \
            or one_minus_pi.shape[:-1] != (b, h) or t > n:
        raise ValueError(f"hajek_step (Triton): shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"bias {tuple(bias.shape)}, one_minus_pi {tuple(one_minus_pi.shape)} disagree")
    flat = lambda x: x.reshape(b * h, *x.shape[2:])  # noqa: E731
    q, k, v, bias = (flat(x if x.stride(-1) == 1 else x.contiguous()) for x in (q, k, v, bias))
    bias, one_minus_pi = bias.float(), flat(one_minus_pi.float().contiguous())
    out = q.new_empty((b * h, rows, dv), dtype=torch.float32)
    var = torch.empty_like(out)
    sums = out.new_empty((b * h, rows, 2))
    if b * h * rows:
        grid = (b * h, -(-rows // BLOCK_ROWS))
        _kernel()[grid](q, k, v, bias, one_minus_pi, out, var, sums, rows, n, t, float(scale), SMALLEST_KEPT,
                        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0, bias.stride(2),
                        one_minus_pi.stride(0), out.stride(0), out.stride(1), sums.stride(0), sums.stride(1),
                        D=d, DV=dv, BR=BLOCK_ROWS, BN=BLOCK_SLOTS, num_warps=NUM_WARPS)
    if terms is not None:
        terms.copy_(sums.reshape(b, h, rows, 2))
    return out.reshape(b, h, rows, dv), var.reshape(b, h, rows, dv)


_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_for(capability: int, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                value_dim: int | None = None, *, block_slots: int = BLOCK_SLOTS, num_warps: int = NUM_WARPS):
    """The kernel compiled ahead of time for an NVIDIA GPU of compute ``capability`` (80: A100, 90: H100/H200),
    for a cache of ``dtype`` and these head sizes; no GPU needed. Returns Triton's ``CompiledKernel`` (its
    ``asm["cubin"]`` and ``metadata.shared``, the bytes of shared memory a program asks for). Raises
    RuntimeError under ``TRITON_INTERPRET=1``, where there is no compiler to run.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    value_dim = value_dim or head_dim
    if not supports(head_dim, value_dim):
        raise ValueError(f"compile_for: head sizes d={head_dim}, dv={value_dim} must be powers of two >= 16")
    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"compile_for: dtype {dtype} is not one of {', '.join(map(str, _TRITON_DTYPES))}")
    kernel = _kernel()
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError("compile_for: the kernel was built for Triton's interpreter (TRITON_INTERPRET=1)")
    constants = {"D": head_dim, "DV": value_dim, "BR": BLOCK_ROWS, "BN": block_slots}
    pointers = {"q_ptr", "k_ptr", "v_ptr"}
    signature = {name: "constexpr" if name in constants else f"*{_TRITON_DTYPES[dtype]}" if name in pointers
                 else "*fp32" if name.endswith("_ptr") else "fp32" if name in ("scale", "tiny") else "i32"
                 for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})


__all__ = ["compile_for", "hajek_step", "supports"]

"""Where the certificate's decode time goes on the PyTorch path (``KVCERT_KERNELS=0``), SmolLM2-135M-Instruct.

The path a GPU takes computes a certified call in float32 with separate operations (``hajek_with_variance``:
an explicit softmax, then the variance's sums), where an uncertified call is one fused SDPA. To tell the
operations that compute the variance from everything else the certificate costs (the certified call's
bookkeeping, the ``CertificateRecorder``'s reductions, the step records), four configurations decode the
same prompt from one shared prefill, their forward passes interleaved as in ``certificate_overhead.py``:

  (c)     Poisson with the Hájek offset, no certificate (one SDPA call per layer);
  (d)     (c) + certificate, as shipped;
  (d_out) (d) with the variance left out: the certified call computes the Hájek output only (explicit float32
          logits, softmax and weighted sum) and hands the recorder zeros for the variance and its terms;
  (d_sdpa) (d) with the output computed by SDPA, as in (c), and zeros for the variance;
  (d_floor) less than a correct certified call can do: the output and the per-slot sums of a trace-only variance
          from one matmul of the stacked weights [a; c] with the values (c = (1 − π) a²), the tail's centre and
          squared distances to it computed once per decode and layer (a per-slot tensor kept past the call,
          which the library must not keep), the per-row combination of the sums left out, and the recorder
          skipped (no per-call summaries, no step records).

(d_out), (d_sdpa) and (d_floor) are instruments, not library behaviour: for their passes only, the function the
certified call uses (``kvcert.attention.hajek_with_variance``) is replaced (and for (d_floor) the recorder's
``add`` is a no-op). So d_sdpa/c is what the certificate costs before any of its arithmetic, d_out/c adds the
explicit attention, d/c adds the variance's operations, and d_floor/c is what remains when even part of that
work is dropped: a floor for what rearranging PyTorch operations could reach on this path. The table gives
the median milliseconds per decode step and each ratio over (c) as the median [interquartile range] of the
per-round ratios, after a warm-up round.

    python benchmarks/certificate_overhead_parts.py [--contexts 1000 4000] [--reps 9]   (sets KVCERT_KERNELS=0)
"""

from __future__ import annotations

import os
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

import kvcert
import kvcert.attention
from certificate_overhead import median_quartiles, prompt_ids, timing_parser
from kvcert.certificates import CertificateRecorder
from kvcert.estimator import _SMALLEST_KEPT
from kvcert.kernels import DISABLE_ENV

SHIPPED = kvcert.attention.hajek_with_variance


def _zeros(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero trace (…, rows, 1) and zero term sums (…, rows, 2) for ``out`` (…, rows, dv)."""
    return out.new_zeros((*out.shape[:-1], 1)), out.new_zeros((*out.shape[:-1], 2))


def output_only(q, k, v, bias, scale, one_minus_pi, per_coordinate=True, check_empty=True):
    """The Hájek output as ``hajek_with_variance`` computes it (q (h, rows, d), k, v (h, n, d), bias
    (h, 1 or rows, n)), without the variance."""
    weights = torch.softmax(torch.baddbmm(bias, q, k.transpose(-1, -2), alpha=scale), dim=-1)
    out = torch.bmm(weights, v)
    return (out, *_zeros(out))


def sdpa_only(q, k, v, bias, scale, one_minus_pi, per_coordinate=True, check_empty=True):
    """The Hájek output by SDPA, as the uncertified call computes it, without the variance."""
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias[None], scale=scale)[0]
    return (out, *_zeros(out))


class TraceFloor:
    """(d_floor): the output and a trace-only variance's per-slot sums, with per-decode tail statistics.

    Called as ``hajek_with_variance`` (q (h, rows, d), k, v (h, n, d), bias (h, 1 or rows, n), one_minus_pi
    (h, t)); returns the output and None for the variance and terms, which the skipped recorder never reads.
    tr V = Σc‖v − μ‖² − 2(ô − μ)·Σc(v − μ) + ‖ô − μ‖²Σc needs per row Σc, Σc‖v − μ‖² (one matmul with the
    per-decode [1, ‖v − μ‖²]) and Σcv (stacked with the output's matmul); Σc² is the effective-terms count's.
    """

    def __init__(self):
        self.prepared: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, q, k, v, bias, scale, one_minus_pi, per_coordinate=True, check_empty=True):
        h, rows, n, t = q.shape[0], q.shape[-2], k.shape[-2], one_minus_pi.shape[-1]
        key = (v.data_ptr(), t)  # a decode's layer keeps its value buffer (spare capacity) and tail
        if key not in self.prepared:
            tail = v[..., :t, :]
            capacity = max(n, v.stride(0) // v.stride(1))  # slots the buffer holds, the appended ones included
            padded = v.new_zeros((h, capacity))
            padded[:, :t] = one_minus_pi
            stats = v.new_zeros((h, capacity, 2))
            stats[:, :t, 0] = 1.0
            stats[:, :t, 1] = (tail - tail.mean(-2, keepdim=True)).square().sum(-1)
            self.prepared[key] = (padded, stats)
        padded, stats = self.prepared[key]
        weights = torch.softmax(torch.baddbmm(bias, q, k.transpose(-1, -2), alpha=scale), dim=-1)
        c = weights.square().mul_(padded[:, None, :n])
        torch.nn.functional.threshold_(c, _SMALLEST_KEPT[torch.float32], 0.0)
        out = torch.bmm(torch.cat([weights, c], dim=-2), v)[:, :rows]
        torch.bmm(c, stats[:, :n])
        torch.linalg.vecdot(c, c)
        return out, None, None


TRACE_FLOOR = TraceFloor()
RECORDER_ADD = CertificateRecorder.add


def _skip_recording(*args, **kwargs) -> None:
    """(d_floor)'s recorder: hands nothing over (no per-call summaries, no step records)."""


# name: (certify, the certified call's function, the recorder records)
CONFIGS = {"c": (False, SHIPPED, True), "d": (True, SHIPPED, True), "d_out": (True, output_only, True),
           "d_sdpa": (True, sdpa_only, True), "d_floor": (True, TRACE_FLOOR, False)}


def interleaved_round(model, state, selection, new_tokens: int, reverse: bool) -> dict[str, float]:
    """One decode per configuration, forward passes interleaved; seconds per forward pass of each. Raises
    AssertionError unless every configuration decoded the same tokens (the instruments change no output)."""
    order = list(reversed(CONFIGS)) if reverse else list(CONFIGS)
    seconds, passes, decodings = dict.fromkeys(order, 0.0), dict.fromkeys(order, 0), {}
    TRACE_FLOOR.prepared.clear()

    def timed(name, call):
        _, function, records = CONFIGS[name]
        kvcert.attention.hajek_with_variance = function
        if not records:
            CertificateRecorder.add = _skip_recording
        try:
            start = time.perf_counter()
            result = call()
            seconds[name] += time.perf_counter() - start
        finally:
            kvcert.attention.hajek_with_variance = SHIPPED
            CertificateRecorder.add = RECORDER_ADD
        return result

    for name in order:
        decodings[name] = timed(name, lambda: kvcert.Decoding(model, state, [selection], max_new_tokens=new_tokens,
                                                                 stop_ids=set(), certify=CONFIGS[name][0]))
    assert all(decodings[name].recorder.path.name == "pytorch" for name in order if CONFIGS[name][0])
    running = order
    while running:
        still = []
        for name in running:
            if timed(name, decodings[name].advance):
                passes[name] += 1
                still.append(name)
        running = still[::-1]  # alternate the order from pass to pass
    tokens = {name: timed(name, decodings[name].results)[0].token_ids for name in order}
    assert all(t == tokens["c"] for t in tokens.values()), tokens
    return {name: seconds[name] / max(1, passes[name]) for name in order}


def main(argv: list[str] | None = None) -> int:
    args = timing_parser(__doc__).parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = kvcert.load_model("smollm2")
    with mock.patch.dict(os.environ, {DISABLE_ENV: "0"}):  # every decoding here takes the PyTorch path
        return _table(model, tokenizer, args)


def _table(model, tokenizer, args) -> int:
    print(f"PyTorch path; budget {args.budget}, {args.new_tokens} new tokens, {args.threads} threads, median of "
          f"{args.reps} rounds; ratios: median [interquartile range] of the per-round ratios over (c)")
    others = [name for name in CONFIGS if name != "c"]
    print("| context | c ms/step | " + " | ".join(f"{n}/c" for n in others) + " |")
    print("|---|---|" + "---|" * len(others))
    for context in args.contexts:
        state = kvcert.prefill(model, prompt_ids(tokenizer, context))
        selection = kvcert.select(state, "snapkv", "poisson", args.budget, seed=0)
        rounds = [interleaved_round(model, state, selection, args.new_tokens, reverse=rep % 2 == 1)
                  for rep in range(args.reps + 1)][1:]  # round 0 is the warm-up
        cells = [str(state.context_tokens), f"{1e3 * statistics.median(r['c'] for r in rounds):.1f}"]
        for name in others:
            median, q1, q3 = median_quartiles([r[name] / r["c"] for r in rounds])
            cells.append(f"{median:.3f} [{q1:.3f}, {q3:.3f}]")
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The certificate statistics of a decode: what the attention hands over after each certified call, and
the per-pass records computed from it (docs/METHOD.md §4, §6).

A ``CertificateRecorder`` belongs to the decoding that certifies (``kvcert.context``). The attention function
gives it, per compressed layer and forward pass, what it computed in the call itself: the Hájek output, its
variance and the variance's term sums, one row each per query row (the compiled kernel or
``kvcert.estimator.hajek_with_variance``), and the oracle's full-cache output in oracle mode. Nothing per slot
reaches the recorder: each call is reduced when it is handed over to a few numbers per (row, KV head, query
position), and once a forward pass is complete (the next one starts, or ``records`` is read) its layers'
summaries are stacked into one ``StepRecord``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .estimator import effective_terms
from .kernels import AttentionPath

WALD_Z = 1.959963984540054  # two-sided nominal 95% normal quantile


@dataclass
class StepRecord:
    """Statistics of one forward pass over the compressed layers ``layers``, for query steps first_step, ….

    Tensors are (len(layers), batch, kv_heads, m) for the m query positions of the pass, float32; the
    query heads of a KV head are stacked into one output vector (so traces add and norms are of the
    concatenation). tail_ess is the effective number (Σc)²/Σc² of the terms c = (1 − π) a² behind tr V̂,
    over the KV head's query heads and sampled slots (0 where no sampled slot has weight; docs/METHOD.md
    §7). true_err and wald_coverage are set in oracle mode.
    """

    layers: tuple[int, ...]
    first_step: int
    trace_var: torch.Tensor
    out_norm: torch.Tensor
    tail_ess: torch.Tensor
    true_err: torch.Tensor | None = None
    wald_coverage: torch.Tensor | None = None


@dataclass
class _CallSummary:
    """One certified attention call reduced to what its StepRecord keeps, per (batch, kv_head, query position):
    trace_var, out_norm, true_err, wald_coverage (m,)-shaped, and terms (…, m, 2), the (Σc, Σc²) of the group's
    query heads pooled. All (batch, kv_heads, m[, 2]) float32."""

    layer: int
    first_step: int
    trace_var: torch.Tensor
    out_norm: torch.Tensor
    terms: torch.Tensor
    true_err: torch.Tensor | None = None
    wald_coverage: torch.Tensor | None = None


class CertificateRecorder:
    """Records the certificate statistics of the certified attention calls of one decoding.

    prefix_length: the logical length of the prefix (steps are counted from it); oracle: per-coordinate
    variance and true errors are recorded; path: which certified-attention implementation runs (``kernel`` is
    the compiled op, or None for the PyTorch path). Each call is reduced when it is handed over, so what the
    recorder holds is a few numbers per (row, KV head, query position) and layer, never a tensor per slot or
    per value coordinate.
    """

    def __init__(self, prefix_length: int, *, oracle: bool, path: AttentionPath):
        self.prefix_length = prefix_length
        self.oracle = oracle
        self.path = path
        self.kernel = path.op
        self._records: list[StepRecord] = []
        self._pending: list[_CallSummary] = []

    def add(self, layer: int, length: int, shape: tuple[int, ...], out: torch.Tensor, var: torch.Tensor,
            terms: torch.Tensor, full_out: torch.Tensor | None) -> None:
        """Hand over one certified call on layer ``layer``, whose cache now holds ``length`` tokens.

        shape = (batch, kv_heads, group, m, dv); out, full_out: (batch·kv_heads, group·m, dv) or (batch, kv_heads,
        group·m, dv); var: the same with width dv per coordinate (needed with the oracle) or 1, the trace; terms:
        the same with width 2, (Σc, Σc²) per query row.
        """
        if self._pending and layer <= self._pending[-1].layer:
            self._flush()
        b, hk, group, m, dv = shape
        reduce = (2, 4)  # the group's query heads and the value coordinates form one vector per KV head
        out = out.reshape(shape)
        var = var.reshape(b, hk, group, m, -1)
        summary = _CallSummary(
            layer=layer, first_step=length - m - self.prefix_length,
            trace_var=var.sum(dim=reduce).float(),
            out_norm=torch.linalg.vector_norm(out, dim=reduce).float(),
            # the group's query heads pool their terms, as their outputs form one vector
            terms=terms.reshape(b, hk, group, m, 2).sum(dim=2),
        )
        if full_out is not None:
            err = out - full_out.to(out.dtype).reshape(shape)
            summary.true_err = torch.linalg.vector_norm(err, dim=reduce).float()
            summary.wald_coverage = (err.abs() <= WALD_Z * var.sqrt()).float().mean(dim=reduce)
        self._pending.append(summary)

    @property
    def records(self) -> list[StepRecord]:
        """The ``StepRecord``s of every pass so far (completing the current one)."""
        if self._pending:
            self._flush()
        return self._records

    def _flush(self) -> None:
        groups: dict[tuple, list[_CallSummary]] = {}
        for call in self._pending:
            groups.setdefault((call.first_step, call.trace_var.shape, call.true_err is None), []).append(call)
        self._records.extend(self._stack(calls) for calls in groups.values())
        self._pending = []

    @staticmethod
    def _stack(calls: list[_CallSummary]) -> StepRecord:
        """The StepRecord of the calls of one pass (same first step and shape): their summaries stacked.

        Each layer's summary was computed on that layer's device; a model dispatched over several devices
        (accelerate's device_map) has them gathered on the first layer's (a few numbers per KV head and query)."""
        device = calls[0].trace_var.device
        stack = lambda name: torch.stack([getattr(c, name).to(device) for c in calls])  # noqa: E731
        record = StepRecord(
            layers=tuple(c.layer for c in calls), first_step=calls[0].first_step, trace_var=stack("trace_var"),
            out_norm=stack("out_norm"), tail_ess=effective_terms(stack("terms")).float(),
        )
        if calls[0].true_err is not None:
            record.true_err, record.wald_coverage = stack("true_err"), stack("wald_coverage")
        return record


__all__ = ["CertificateRecorder", "StepRecord", "WALD_Z"]

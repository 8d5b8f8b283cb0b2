"""The certificate statistics of a decode: what the attention hands over after each certified call, and
the per-pass records computed from it (docs/METHOD.md §4, §6).

A ``CertificateRecorder`` belongs to the decoding that certifies (``kvcert.context``). The attention function
gives it, per compressed layer and forward pass, what it computed in the call itself: the Hájek output, its
variance and the variance's term sums, one row each per query row (the compiled kernel or
``kvcert.estimator.hajek_with_variance``), and the oracle's full-cache output in oracle mode. Nothing per slot
reaches the recorder. Once a forward pass is complete (the next one starts, or ``records`` is read) the
statistics of all its layers are computed at once, a few tensor operations per pass instead of a few per
layer. One ``StepRecord`` per pass results.
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
class _PendingStep:
    """One certified attention call, kept until its forward pass is complete: per query row only.

    shape = (batch, kv_heads, group, m, dv). out, full_out: (batch·kv_heads, group·m, dv) or (batch, kv_heads,
    group·m, dv); var: the same with width dv per coordinate (oracle mode) or 1, the trace; terms: (Σc, Σc²)
    per query row, width 2.
    """

    layer: int
    first_step: int
    shape: tuple[int, ...]
    out: torch.Tensor
    var: torch.Tensor
    terms: torch.Tensor
    full_out: torch.Tensor | None


def _stack_rows(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Stack per-layer (batch·kv_heads, group·m, ·) or (batch, kv_heads, group·m, ·) tensors into
    (L, batch·kv_heads, group·m, ·); shape = (L, batch, kv_heads, group, m, dv)."""
    rows, width = shape[1] * shape[2], shape[3] * shape[4]
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors).reshape(len(tensors), rows, width, -1)
    return torch.stack([t.reshape(rows, width, -1) for t in tensors])


class CertificateRecorder:
    """Records the certificate statistics of the certified attention calls of one decoding.

    prefix_length: the logical length of the prefix (steps are counted from it); oracle: per-coordinate
    variance and true errors are recorded; path: which certified-attention implementation runs (``kernel`` is
    the compiled op, or None for the PyTorch path).
    """

    def __init__(self, prefix_length: int, *, oracle: bool, path: AttentionPath):
        self.prefix_length = prefix_length
        self.oracle = oracle
        self.path = path
        self.kernel = path.op
        self._records: list[StepRecord] = []
        self._pending: list[_PendingStep] = []

    def add(self, layer: int, length: int, shape: tuple[int, ...], out: torch.Tensor, var: torch.Tensor,
            terms: torch.Tensor, full_out: torch.Tensor | None) -> None:
        """Hand over one certified call on layer ``layer``, whose cache now holds ``length`` tokens (see
        ``_PendingStep`` for the shapes)."""
        if self._pending and layer <= self._pending[-1].layer:
            self._flush()
        first_step = length - shape[3] - self.prefix_length
        self._pending.append(_PendingStep(layer, first_step, shape, out, var, terms, full_out))

    @property
    def records(self) -> list[StepRecord]:
        """The ``StepRecord``s of every pass so far (completing the current one)."""
        if self._pending:
            self._flush()
        return self._records

    def _flush(self) -> None:
        groups: dict[tuple, list[_PendingStep]] = {}
        for step in self._pending:
            groups.setdefault((step.first_step, step.shape, step.full_out is None), []).append(step)
        self._records.extend(self._summarize(steps) for steps in groups.values())
        self._pending = []

    def _summarize(self, steps: list[_PendingStep]) -> StepRecord:
        """The StepRecord of the calls of one pass (same first_step and shape), computed for all layers at once."""
        shape = (len(steps), *steps[0].shape)  # (L, batch, kv_heads, group, m, dv)
        layers = tuple(s.layer for s in steps)
        out = _stack_rows([s.out for s in steps], shape)  # (L, batch·kv_heads, group·m, dv)
        variances = [s.var for s in steps]
        if len({v.shape[-1] for v in variances}) > 1:  # a pass mixing the kernel (per coordinate) and the trace
            variances = [v.sum(-1, keepdim=True) for v in variances]
        var = _stack_rows(variances, shape).reshape(*shape[:-1], -1)
        terms = _stack_rows([s.terms for s in steps], shape)
        out = out.reshape(shape)
        reduce = (3, 5)  # the group's query heads and the value coordinates form one vector per KV head
        record = StepRecord(
            layers=layers,
            first_step=steps[0].first_step,
            trace_var=var.sum(dim=reduce).float(),
            out_norm=torch.linalg.vector_norm(out, dim=reduce).float(),
            # the group's query heads pool their terms, as their outputs form one vector
            tail_ess=effective_terms(terms.reshape(*shape[:-1], 2).sum(dim=3)).float(),
        )
        if steps[0].full_out is not None:
            err = out - torch.stack([s.full_out.to(out.dtype) for s in steps]).reshape(shape)
            record.true_err = torch.linalg.vector_norm(err, dim=reduce).float()
            record.wald_coverage = (err.abs() <= WALD_Z * var.sqrt()).float().mean(dim=reduce)
        return record


__all__ = ["CertificateRecorder", "StepRecord", "WALD_Z"]

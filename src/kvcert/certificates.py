"""The certificate statistics of a decode: what the attention hands over after each certified call, and
the per-pass records computed from it (docs/METHOD.md §4, §6).

A ``CertificateRecorder`` belongs to one ``CompressedCache`` (which only stores slots). The attention
function gives it, per compressed layer and forward pass, the Hájek output, the oracle's full-cache output
(oracle mode) and either the attention weights of the layer's sampled slots (PyTorch path) or the
per-coordinate variance the compiled kernel already computed. Nothing is computed at that point: once a
forward pass is complete (the next one starts, or ``records`` is read) the variance and the statistics of
all its layers are computed at once, a few tensor operations per pass instead of a few per layer, off the
attention's critical path. One ``StepRecord`` per pass results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .estimator import TailMoments, effective_terms, linearized_variance, tail_moments
from .kernels import AttentionPath

if TYPE_CHECKING:
    from .cache import CompressedLayer

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
    """One certified attention call, kept raw until its forward pass is complete.

    out/full_out: (batch·kv_heads, group·m, dv); shape = (batch, kv_heads, group, m, dv). Either
    sampled_attention, (batch·kv_heads, group·m, t), the softmax weights of the layer's t sampled slots, or
    var, the per-coordinate variance the compiled kernel already computed, with terms, its (Σc, Σc²) per
    query row, (batch, kv_heads, group·m, 2). With var, out and var may also come unflattened,
    (batch, kv_heads, group·m, dv), as the kernel returns them.
    """

    layer: int
    first_step: int
    shape: tuple[int, ...]
    out: torch.Tensor
    sampled_attention: torch.Tensor | None
    full_out: torch.Tensor | None
    var: torch.Tensor | None = None
    terms: torch.Tensor | None = None


def _stack_rows(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Stack per-layer (batch·kv_heads, group·m, ·) or (batch, kv_heads, group·m, ·) tensors into
    (L, batch·kv_heads, group·m, ·); shape = (L, batch, kv_heads, group, m, dv)."""
    rows, width = shape[1] * shape[2], shape[3] * shape[4]
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors).reshape(len(tensors), rows, width, -1)
    return torch.stack([t.reshape(rows, width, -1) for t in tensors])


class CertificateRecorder:
    """Computes and records the certificate statistics of the certified attention calls on ``layers``.

    layers: the cache's layers (read for their sampled values and 1 − π); prefix_length: the logical length
    of the prefix (steps are counted from it); oracle: per-coordinate variance and true errors are recorded;
    path: which certified-attention implementation runs (``kernel`` is the compiled op, or None for the
    PyTorch path).
    """

    def __init__(self, layers: list[CompressedLayer], prefix_length: int, *, oracle: bool, path: AttentionPath):
        self.layers = layers
        self.prefix_length = prefix_length
        self.oracle = oracle
        self.path = path
        self.kernel = path.op
        self._records: list[StepRecord] = []
        self._pending: list[_PendingStep] = []
        self._moments: dict[tuple[int, ...], TailMoments] = {}

    def add(self, layer: int, shape: tuple[int, ...], out: torch.Tensor, sampled_attention: torch.Tensor | None,
            full_out: torch.Tensor | None, var: torch.Tensor | None = None, terms: torch.Tensor | None = None) -> None:
        """Hand over one certified call on layer ``layer`` (see ``_PendingStep`` for the shapes); a call with
        ``var`` brings its ``terms`` too."""
        if self._pending and layer <= self._pending[-1].layer:
            self._flush()
        first_step = self.layers[layer].length - shape[3] - self.prefix_length
        self._pending.append(_PendingStep(layer, first_step, shape, out, sampled_attention, full_out, var, terms))

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

    def _tail_moments(self, layers: tuple[int, ...], dtype: torch.dtype) -> TailMoments:
        """TailMoments of the sampled slots of ``layers``, stacked: (L, batch·kv_heads, ·, ·), padded to the
        longest tail with zero weight. The sampled slots never change, so this is computed once per group."""
        if layers not in self._moments:
            first = self.layers[layers[0]]
            t_max = max(self.layers[i].n_sampled_slots for i in layers)
            rows, dv = first.values.shape[0] * first.values.shape[1], first.values.shape[-1]
            values = first.values.new_zeros((len(layers), rows, t_max, dv), dtype=dtype)
            one_minus_pi = values.new_zeros((len(layers), rows, t_max))
            for j, i in enumerate(layers):
                layer, t = self.layers[i], self.layers[i].n_sampled_slots
                values[j, :, :t] = layer.values[:, :, :t].flatten(0, 1)
                one_minus_pi[j, :, :t] = layer.one_minus_pi.flatten(0, 1)
            self._moments[layers] = tail_moments(values, one_minus_pi, per_coordinate=self.oracle)
        return self._moments[layers]

    def _variance(self, steps: list[_PendingStep], out: torch.Tensor,
                  shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The variance of each call, (L, batch·kv_heads, group·m, width): width dv per coordinate (oracle, or
        every call computed by the kernel), else 1 (the trace); and its terms (Σc, Σc²) per query row,
        (L, batch·kv_heads, group·m, 2). out: the calls' outputs, stacked; shape: (L, batch, kv_heads, group,
        m, dv)."""
        if all(s.var is not None for s in steps):
            return _stack_rows([s.var for s in steps], shape), _stack_rows([s.terms for s in steps], shape)
        fused = [i for i, s in enumerate(steps) if s.var is not None]
        pending = [i for i, s in enumerate(steps) if s.var is None]
        tail = self._tail_moments(tuple(steps[i].layer for i in pending), out.dtype)
        weights = out.new_zeros((len(pending), *out.shape[1:-1], tail.one_minus_pi.shape[-1]))
        for j, i in enumerate(pending):
            weights[j, ..., : steps[i].sampled_attention.shape[-1]] = steps[i].sampled_attention
        computed, computed_terms = linearized_variance(weights, out[pending], tail, terms=True)
        if not fused:
            return computed, computed_terms
        var = computed.new_empty((len(steps), *computed.shape[1:]))
        terms = computed_terms.new_empty((len(steps), *computed_terms.shape[1:]))
        var[pending], terms[pending] = computed, computed_terms
        for i in fused:
            v = steps[i].var.reshape(var.shape[1:-1] + steps[i].var.shape[-1:])
            var[i] = v if tail.per_coordinate else v.sum(-1, keepdim=True)
            terms[i] = steps[i].terms.reshape(terms.shape[1:])
        return var, terms

    def _summarize(self, steps: list[_PendingStep]) -> StepRecord:
        """The StepRecord of the calls of one pass (same first_step and shape), computed for all layers at once."""
        shape = (len(steps), *steps[0].shape)  # (L, batch, kv_heads, group, m, dv)
        layers = tuple(s.layer for s in steps)
        out = _stack_rows([s.out for s in steps], shape)  # (L, batch·kv_heads, group·m, dv)
        var, terms = self._variance(steps, out, shape)
        var = var.reshape(*shape[:-1], -1)
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

"""Generation on a compressed cache: one shared prefill, then any number of configurations (docs/METHOD.md).

``prefill`` runs the model once over the prefix (context + question in the question-aware setting, the
context alone in the streaming setting) and keeps what the policies need. ``select`` turns a policy,
a design, a budget and a seed into retained sets; ``decode`` generates greedily on a cache derived from
the prefill (the prefill itself is never modified, so every configuration starts from the same state).
``decode_configurations`` does both for a list of configurations: the one decode path of ``generate``
(a prefill and one configuration) and of the cell runner (a prefill and a batch per budget).
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from . import run_schema
from .attention import attach
from .allocators import LayerBudget, get_allocator
from .cache import CompressedCache
from .certificates import CertificateRecorder
from .context import AttentionContext, Observation
from .designs import DesignOptions, Selection, check_design_defenses, clt_design, get_design, window_attention_mass
from .estimator import certificate
from .kernels import attention_path
from .peer_sampling import CLTOptions
from .policies import LayerView, get_policy, prefill_needs
from .query_statistics import FUTURE_POSITIONS, QueryStatistics, rotary_tables, unrotate
from .prompts import build_prompt, check_setting, model_limit
from .table_columns import STEP_COLUMNS
from .targets import (Target, TargetNotMetWarning, calibrated_scales, cap_binding_message, check_target,
                      targeted_selections)

FULL = "full"
RUN = run_schema.RUN  # the run schema: the defaults here are a cell's


def item_seed(seed: int, item_id: str) -> int:
    """The Poisson seed of one item: derived from (seed, item id), so that items do not share one stream of
    draws. The cell runner seeds every item this way; ``generate(item_id=...)`` does too."""
    return zlib.crc32(f"{seed}:{item_id}".encode()) & 0x7FFFFFFF


@dataclass
class Prefill:
    """The shared state of one prompt.

    cache: the prefix's cache; observations: per layer, what the prefill recorded for the policies;
    prefix_ids: (1, n) prefilled tokens; suffix_ids: (1, s) tokens fed after compression (the question in the
    streaming setting; empty otherwise); last_logits: (1, vocab) float32 logits after the prefix.
    """

    cache: CompressedCache
    observations: list[Observation]
    prefix_ids: torch.Tensor
    suffix_ids: torch.Tensor
    last_logits: torch.Tensor
    setting: str
    policy_options: dict = field(default_factory=dict)  # policy name -> keyword options of that policy
    _scores: dict = field(default_factory=dict)

    @property
    def context_tokens(self) -> int:
        return self.prefix_ids.shape[-1]

    def layer_views(self) -> list[LayerView]:
        return [layer_view(layer, obs) for layer, obs in zip(self.cache.layers, self.observations)]

    def scores(self, policy_name: str) -> list[torch.Tensor]:
        """Per-layer scores (batch, kv_heads, n) of a policy, computed once per prefill. A policy that draws (a
        sketched leverage) draws layer i's from a generator seeded i, never from torch's global generator, whose
        state depends on whatever ran before in the process (a model conversion, a resumed shard)."""
        if policy_name not in self._scores:
            policy = get_policy(policy_name, **self.policy_options.get(policy_name, {}))
            self._scores[policy_name] = [policy.score(view, torch.Generator().manual_seed(i))
                                         for i, view in enumerate(self.layer_views())]
        return self._scores[policy_name]


def layer_view(layer, obs: Observation) -> LayerView:
    """What a policy reads of one prefilled layer: its keys/values (batch, kv_heads, n, head_dim) and what the
    prefill observed there."""
    return LayerView(
        keys=layer.keys,
        values=layer.values,
        window_queries=obs.window_queries,
        accumulated_attention=obs.accumulated_attention,
        scale=obs.scale,
        sliding_window=obs.sliding_window,
        query_statistics=obs.query_statistics,
        output_projection=obs.output_projection,
        pre_rope_keys=obs.pre_rope_keys,
    )


@torch.no_grad()
def prefill(
    model,
    prefix_ids: torch.Tensor,
    suffix_ids: torch.Tensor | None = None,
    *,
    setting: str = "question_aware",
    observation_window: int = RUN.observation_window,
    accumulate: bool = False,
    query_statistics: bool = False,
    pre_rope_keys: bool = False,
    policy_options: dict | None = None,
) -> Prefill:
    """Run the model over ``prefix_ids`` (1, n) once, recording what the scoring policies need.

    observation_window: the last prompt tokens whose queries SnapKV and TOVA score with; accumulate: also
    collect each key's accumulated attention (needed by h2o and observed_attention; one more O(n²) pass);
    query_statistics: also collect the queries' mean and covariance before RoPE and the rotary tables after
    the prefix (needed by expected_attention and cap; O(n·d²) per layer); pre_rope_keys: also keep the keys
    before RoPE, the prefix's keys un-rotated with the model's rotary tables (needed by leverage; one float32
    copy of the keys); ``kvcert.policies.prefill_needs`` says which a set of policies needs; policy_options: per
    policy name, keyword options of that policy (e.g. ``{"snapkv": {"kernel_size": 7, "pooling": "max"}}``).
    """
    check_setting(setting)
    if prefix_ids.ndim != 2 or prefix_ids.shape[0] != 1:
        raise ValueError(f"prefix_ids must be (1, n); got {tuple(prefix_ids.shape)}")
    if prefix_ids.shape[-1] == 0:
        raise ValueError("the prefix is empty: nothing to prefill")
    device = next(model.parameters()).device
    prefix_ids = prefix_ids.to(device)
    suffix_ids = (suffix_ids if suffix_ids is not None else prefix_ids[:, :0]).to(device)
    recording = PrefillRecording.start(model, prefix_ids.shape[-1], observation_window=observation_window,
                                       accumulate=accumulate, query_statistics=query_statistics,
                                       pre_rope_keys=pre_rope_keys)
    # Only the last position's logits are needed; the full (n, vocab) matrix would dominate the prefill.
    with attach(model, recording.context):  # bound, not passed as a keyword: some architectures do not forward keywords
        out = model(input_ids=prefix_ids, cache=recording.context.cache, use_cache=True, logits_to_keep=1)
    return recording.finish(prefix_ids, suffix_ids, out.logits[:, -1].float(), setting, policy_options)


@dataclass
class PrefillRecording:
    """What a prefill records while the model runs over the prefix: the observed context (an empty
    ``CompressedCache`` and one ``Observation`` per layer) and, where asked, the rotary tables of the prefix and
    its future positions. ``prefill`` runs the model between ``start`` and ``finish``; ``kvcert.press`` lets
    ``model.generate`` run it."""

    context: AttentionContext
    n: int
    tables: list | None
    pre_rope_keys: bool

    @classmethod
    def start(cls, model, n: int, *, observation_window: int, accumulate: bool, query_statistics: bool,
              pre_rope_keys: bool) -> PrefillRecording:
        """An empty observed context for a prefix of ``n`` tokens (see ``prefill`` for the options)."""
        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        ctx = AttentionContext.for_prefill(n_layers, observation_window=observation_window, accumulate=accumulate)
        tables = rotary_tables(model, n + FUTURE_POSITIONS) if query_statistics or pre_rope_keys else None
        if query_statistics:
            for obs, layer_tables in zip(ctx.observations, tables):
                obs.query_statistics = QueryStatistics(layer_tables)
        return cls(ctx, n, tables, pre_rope_keys)

    def finish(self, prefix_ids: torch.Tensor, suffix_ids: torch.Tensor, last_logits: torch.Tensor, setting: str,
               policy_options: dict | None) -> Prefill:
        """The ``Prefill`` once the model has run over ``prefix_ids`` (1, n) on ``context``'s cache;
        last_logits: (1, vocab) float32."""
        ctx = self.context
        for i in range(len(ctx.observations)):
            self.finish_layer(i)
        return Prefill(ctx.cache, ctx.observations, prefix_ids, suffix_ids, last_logits, setting,
                       dict(policy_options or {}))

    def finish_layer(self, i: int) -> None:
        """Complete layer ``i``'s observation once the model has run that layer over the whole prefix: the queries'
        statistics, and the keys before RoPE where asked for."""
        obs, layer, n = self.context.observations[i], self.context.cache.layers[i], self.n
        if obs.query_statistics is not None:
            obs.query_statistics.finish(n)
        if self.pre_rope_keys:  # the prefill's cache holds every prefix key, in position order
            cos, sin = self.tables[i]
            obs.pre_rope_keys = unrotate(layer.keys, cos[:n], sin[:n]).float()


def allocate(
    state: Prefill, budget: float, allocator: str = RUN.allocator, allocator_options: dict | None = None,
    options: DesignOptions = DesignOptions(),
) -> list[LayerBudget]:
    """Per layer, how many slots each KV head keeps (kvcert.allocators) for a budget fraction of the prefix."""
    chosen = get_allocator(allocator, **(allocator_options or {}))
    return chosen.allocate(budget, state.context_tokens, len(state.cache.layers), options.n_sink, options.n_recent)


def select(
    state: Prefill,
    policy: str,
    design: str,
    budget: float,
    seed: int = 0,
    options: DesignOptions = DesignOptions(),
    allocator: str = RUN.allocator,
    allocator_options: dict | None = None,
) -> list[Selection]:
    """Retained sets per layer for one configuration; seeds make Poisson draws reproducible.

    allocator: how many slots each (layer, KV head) keeps (kvcert.allocators: uniform | adakv | pyramidkv),
    with its keyword options; ``uniform`` gives every head round(budget·n).
    """
    design_fn = get_design(design)
    certain_top_slice = get_policy(policy).certain_top_slice
    generator = torch.Generator().manual_seed(int(seed))
    budgets = allocate(state, budget, allocator, allocator_options, options)
    # options.head_attention_share: the window's attention ranks part of the certain head (kvcert.designs)
    attended = design == "poisson" and options.head_attention_share > 0
    masses = [window_attention_mass(view) for view in state.layer_views()] if attended else None
    return [
        design_fn(scores, budget, options, generator=generator, certain_top_slice=certain_top_slice,
                  allocation=layer_budget, **({"attention": masses[i]} if attended else {}))
        for i, (scores, layer_budget) in enumerate(zip(state.scores(policy), budgets))
    ]


class LayerSelector:
    """``select``'s work one layer at a time, in layer order, for a prefix of ``n`` tokens: the same scores (layer
    i's policy generator seeded i), the allocator's count for that layer, and the design's draws from one
    generator seeded ``seed`` taken layer after layer. So a caller can compress each layer as soon as the prefill
    has run it (``kvcert.press``), and the retained sets are ``select``'s. Every allocator qualifies: uniform and
    adakv allocate within a layer, pyramidkv's layer schedule depends only on ``n`` and the layer count. A target
    (its layers' sizes are searched together) and design clt are not offered here: they select after the prefill."""

    def __init__(self, n: int, n_layers: int, policy: str, design: str, budget: float, seed: int = 0,
                 options: DesignOptions = DesignOptions(), allocator: str = RUN.allocator,
                 allocator_options: dict | None = None, policy_options: dict | None = None):
        if design == "clt":
            raise ValueError("LayerSelector: design clt selects after the prefill (use select)")
        self.policy = get_policy(policy, **(policy_options or {}).get(policy, {}))
        self.design_fn = get_design(design)
        self.certain_top_slice = get_policy(policy).certain_top_slice
        self.generator = torch.Generator().manual_seed(int(seed))
        self.budget, self.options = budget, options
        self.budgets = get_allocator(allocator, **(allocator_options or {})).allocate(
            budget, n, n_layers, options.n_sink, options.n_recent)
        self.attended = design == "poisson" and options.head_attention_share > 0
        self.next = 0

    def select(self, i: int, view: LayerView) -> Selection:
        """Layer ``i``'s Selection (index/log_pi (batch, kv_heads, k)); layers must come in order 0, 1, …"""
        if i != self.next:
            raise RuntimeError(f"LayerSelector: layer {i} came before layer {self.next} (layers are selected in order)")
        scores = self.policy.score(view, torch.Generator().manual_seed(i))
        extra = {"attention": window_attention_mass(view)} if self.attended else {}
        selection = self.design_fn(scores, self.budget, self.options, generator=self.generator,
                                   certain_top_slice=self.certain_top_slice, allocation=self.budgets[i], **extra)
        self.next += 1
        return selection


@dataclass
class Decoded:
    """What one configuration produced.

    token_ids: generated ids; logprobs: log-probability of each generated token (greedy);
    steps: one row per (step, layer, kv_head) over compressed attention (empty for the full cache);
    retained_tokens: mean retained prefix slots per layer and KV head; cache_bytes / full_bytes: bytes
    of the compressed cache (its slot buffers, each KV head's row padded to the layer's longest) and of the
    full cache after the prefill; kept_bytes: bytes of the retained prefix slots alone (what a ragged layout
    holds: equal to cache_bytes when every head keeps the same count); attention_path: which implementation
    computed the certified attention (``{"path": "kernel" | "triton" | "pytorch", "reason": ...}``; None when no
    certificate was computed); target_choice: with a target (``kvcert.targets``), the chosen expected sample
    size per layer and KV head (``decode_configurations``; None otherwise).
    """

    token_ids: list[int]
    logprobs: list[float]
    steps: pd.DataFrame
    retained_tokens: float
    cache_bytes: int
    full_bytes: int
    text: str = ""
    attention_path: dict | None = None
    kept_bytes: int = 0
    target_choice: pd.DataFrame | None = None  # with a target: kvcert.targets.CHOICE_COLUMNS per layer and KV head
    # with max_cache_tokens (kvcert.decode_compression): the most slots a (layer, KV head) held after a pass, and
    # how many layer compressions the decoding made; None and 0 without a bound
    peak_cache_tokens: int | None = None
    decode_compressions: int = 0


def _empty_steps() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="float64") for c in STEP_COLUMNS})


def _steps_frame(recorder: CertificateRecorder | None, row: int, delta: float, randomized: bool,
                 limit: int) -> pd.DataFrame:
    """Flatten batch row ``row`` of the recorder's StepRecords into STEP_COLUMNS, keeping steps < limit.

    Tensors are concatenated first and converted once, and every column is computed in numpy before one
    DataFrame is built: per-record conversions or pandas column operations would cost more than the
    certificate itself.
    """
    records = [rec for rec in recorder.records if rec.first_step < limit] if recorder is not None else []
    if not records:
        return _empty_steps()

    def flat(name: str) -> np.ndarray:  # record tensors are (layers, batch, kv_heads, m)
        return torch.cat([getattr(rec, name)[:, row].reshape(-1) for rec in records]).double().cpu().numpy()

    def per_record(values) -> np.ndarray:
        return np.concatenate([np.broadcast_to(v, rec.trace_var[:, row].shape).reshape(-1)
                               for rec, v in zip(records, values)])

    step = per_record(rec.first_step + np.arange(rec.trace_var.shape[-1]) for rec in records)
    layer = per_record(np.asarray(rec.layers)[:, None, None] for rec in records)
    kv_head = per_record(np.arange(rec.trace_var.shape[2])[:, None] for rec in records)
    trace = flat("trace_var")
    missing = np.full(trace.shape, np.nan)
    cert = certificate(torch.from_numpy(trace), delta).numpy() if randomized else missing
    true_err = flat("true_err") if records[0].true_err is not None else missing
    wald = flat("wald_coverage") if records[0].wald_coverage is not None and randomized else missing
    tail_ess = flat("tail_ess") if randomized else missing
    norm = flat("out_norm")
    safe_norm = np.where(norm > 0, norm, np.nan)
    with np.errstate(invalid="ignore"):
        coverage = np.where(np.isfinite(cert) & np.isfinite(true_err), (true_err <= cert).astype(float), np.nan)
    columns = {"step": step, "layer": layer, "kv_head": kv_head, "trace_var": trace, "cert": cert,
               "true_err": true_err, "rel_cert": cert / safe_norm, "rel_err": true_err / safe_norm,
               "coverage": coverage, "wald_coverage": wald, "tail_ess": tail_ess, "out_norm": norm}
    keep = step < limit
    order = np.lexsort((kv_head[keep], layer[keep], step[keep]))  # stable: by step, then layer, then head
    return pd.DataFrame({name: columns[name][keep][order] for name in STEP_COLUMNS})


def eos_ids(model, tokenizer=None) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


def _footprint(state: Prefill, selections: list[Selection] | None) -> tuple[float, int, int, int]:
    """(mean retained prefix slots per layer and KV head, compressed bytes, full bytes, kept bytes) of one
    configuration.

    Bytes count what the configuration holds alone: keys, values, log π, offset and positions of its slots,
    padded to the layer's longest head (compressed) or of the retained slots only (kept).
    """
    retained, compressed, full, kept = [], 0, 0, 0
    for i, layer in enumerate(state.cache.layers):
        r, c, f, k = layer_footprint(layer, None if selections is None else selections[i])
        retained.append(r)
        compressed, full, kept = compressed + c, full + f, kept + k
    return float(np.mean(retained)), compressed, full, kept


def layer_footprint(layer, selection: Selection | None) -> tuple[float, int, int, int]:
    """One prefilled layer's share of ``_footprint``: (mean retained slots per KV head, compressed bytes, full
    bytes, kept bytes); selection None: the full layer."""
    h = layer.keys.shape[1]
    per_head_slot = (layer.keys.shape[-1] * layer.keys.element_size() + layer.values.shape[-1]
                     * layer.values.element_size() + layer.log_pi.element_size() + layer.offset.element_size()
                     + layer.positions.element_size())
    per_slot = h * per_head_slot
    n = layer.keys.shape[-2]
    if selection is None:
        return float(n), n * per_slot, n * per_slot, n * per_slot
    return (float(selection.retained.float().mean()), selection.index.shape[-1] * per_slot, n * per_slot,
            int(selection.retained.sum()) * per_head_slot)


def decoding_context(state: Prefill, configurations: list[list[Selection] | None], *, reserve: int, certify: bool,
                     oracle: bool) -> AttentionContext:
    """The context a decoding attends with: a cache derived from the prefill, one batch row per configuration
    (per-layer Selections, or None for the full cache) with ``reserve`` slots of spare capacity, a
    ``CertificateRecorder`` where some row is compressed and certificates or the oracle are asked for, the
    prefill's uncompressed cache as the oracle, and the decode-time samplers of design clt's rows."""
    any_compressed = any(c is not None for c in configurations)
    cache = state.cache.derive_batch(configurations, reserve=reserve)
    recorder = new_recorder(cache, certify=certify, oracle=oracle) if any_compressed else None
    # design clt's rows: every slot kept, attention estimated by a fresh sample at each query
    samplers = {r: [sel.sampler for sel in c] for r, c in enumerate(configurations)
                if c is not None and c and c[0].sampler is not None}
    return AttentionContext(cache, recorder=recorder, oracle=state.cache if oracle and any_compressed else None,
                            samplers=samplers)


def new_recorder(cache: CompressedCache, *, certify: bool, oracle: bool) -> CertificateRecorder | None:
    """The ``CertificateRecorder`` of a decoding on ``cache`` (some row compressed): steps counted from the cache's
    length, the kernel path of its keys' dtype and device; None when neither certificates nor the oracle are asked."""
    if not (certify or oracle):
        return None
    keys = cache.layers[0].keys
    return CertificateRecorder(max(layer.length for layer in cache.layers), oracle=oracle,
                               path=attention_path(keys.dtype, keys.device))


class Decoding:
    """Greedy generation for several configurations of one prompt, one batch row each, a forward pass at a time.

    configurations: per row, the per-layer Selections (from ``select``) or None for the full cache. The
    model's weights are read once per step for all rows, which is what makes a cell cheap. In the streaming
    setting the suffix (question) is fed first, attending to the compressed cache; its positions carry
    certificates like generated tokens do. randomized: per row, whether the design has a certificate
    (default: some layer of the row has a Poisson tail). ``decode_batch`` runs one to the end; a benchmark
    can interleave the passes of several, so that their step times are measured side by side.
    """

    @torch.no_grad()
    def __init__(
        self,
        model,
        state: Prefill,
        configurations: list[list[Selection] | None],
        *,
        max_new_tokens: int = 16,
        stop_ids: set[int] | None = None,
        certify: bool = True,
        oracle: bool = False,
        delta: float = RUN.delta,
        randomized: list[bool] | None = None,
        compressor=None,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if not configurations:
            raise ValueError("configurations is empty: give at least one (None for the full cache)")
        self.model, self.state, self.configurations = model, state, configurations
        self.max_new_tokens, self.stop_ids, self.delta = max_new_tokens, stop_ids or set(), delta
        rows = len(configurations)
        suffix = state.suffix_ids
        reserve = suffix.shape[-1] + max_new_tokens
        if compressor is not None:  # kvcert.decode_compression: the buffers hold max_cache_tokens slots at most
            if rows != 1 or configurations[0] is None:
                raise ValueError("max_cache_tokens: decode-time compression decodes one compressed configuration "
                                 "at a time")
            widest = max(sel.index.shape[-1] for sel in configurations[0])
            reserve = max(0, min(reserve, compressor.bound.max_cache_tokens - widest))
        self.context = decoding_context(state, configurations, reserve=reserve, certify=certify, oracle=oracle)
        self.context.compressor = compressor
        self.cache, self.recorder = self.context.cache, self.context.recorder
        self.randomized = randomized if randomized is not None else [
            c is not None and any(sel.has_tail for sel in c) for c in configurations
        ]
        self._kwargs = {"cache": self.cache, "use_cache": True}
        if suffix.shape[-1] > 0:
            self._logits = self._forward(suffix.expand(rows, -1), logits_to_keep=1)
        else:
            self._logits = state.last_logits.expand(rows, -1)
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.done = [False] * rows

    @torch.no_grad()
    def advance(self) -> bool:
        """Pick every unfinished row's next token; run the next forward pass unless all rows are done.

        Returns whether a pass was run (False: generation is complete).
        """
        log_probs = torch.log_softmax(self._logits, dim=-1)
        chosen = torch.argmax(log_probs, dim=-1)
        picked = log_probs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        for r in range(len(self.done)):
            if not self.done[r]:
                self.tokens[r].append(int(chosen[r]))
                self.logprobs[r].append(float(picked[r]))
                self.done[r] = self.tokens[r][-1] in self.stop_ids or len(self.tokens[r]) == self.max_new_tokens
        if all(self.done):
            return False
        self._logits = self._forward(chosen.unsqueeze(-1).to(self.state.prefix_ids.device))
        return True

    def _forward(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """One forward pass of (rows, m) ids on the derived cache; the last position's logits (rows, vocab)."""
        if self.context.compressor is not None:
            self.context.compressor.before_pass(self.context, ids.shape[-1])
        with attach(self.model, self.context):  # bound: some architectures do not forward keywords to attention
            return self.model(input_ids=ids, **self._kwargs, **kwargs).logits[:, -1].float()

    def results(self) -> list[Decoded]:
        """One Decoded per row (call once ``advance`` has returned False)."""
        out = []
        suffix_len = self.state.suffix_ids.shape[-1]
        path = self.recorder.path.as_dict() if self.recorder is not None else None
        for r, selections in enumerate(self.configurations):
            retained, cache_bytes, full_bytes, kept_bytes = _footprint(self.state, selections)
            # Steps attending to the compressed cache: the suffix, then every generated token but the last.
            limit = suffix_len + len(self.tokens[r]) - 1
            steps = (_steps_frame(self.recorder, r, self.delta, self.randomized[r], limit) if selections is not None
                     else _empty_steps())
            out.append(Decoded(self.tokens[r], self.logprobs[r], steps, retained, cache_bytes, full_bytes,
                               attention_path=path if selections is not None else None, kept_bytes=kept_bytes))
        if self.context.compressor is not None:
            out[0].peak_cache_tokens = self.context.compressor.peak
            out[0].decode_compressions = self.context.compressor.compressions
        return out


def decode_batch(
    model,
    state: Prefill,
    configurations: list[list[Selection] | None],
    *,
    max_new_tokens: int = 16,
    stop_ids: set[int] | None = None,
    certify: bool = True,
    oracle: bool = False,
    delta: float = RUN.delta,
    randomized: list[bool] | None = None,
    compressor=None,
) -> list[Decoded]:
    """Greedy generation for several configurations of one prompt at once, one batch row each (see ``Decoding``);
    compressor: a ``kvcert.decode_compression.DecodeCompressor`` keeping one configuration's cache under its bound."""
    if not configurations and max_new_tokens >= 1:
        return []  # nothing to decode; Decoding reports every bad argument, an empty list included
    decoding = Decoding(model, state, configurations, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                        certify=certify, oracle=oracle, delta=delta, randomized=randomized, compressor=compressor)
    while decoding.advance():
        pass
    return decoding.results()


def decode(
    model,
    state: Prefill,
    selections: list[Selection] | None,
    *,
    max_new_tokens: int = 16,
    stop_ids: set[int] | None = None,
    certify: bool = True,
    oracle: bool = False,
    delta: float = RUN.delta,
    randomized: bool | None = None,
) -> Decoded:
    """Greedy generation of one configuration (``selections`` None: the full cache); see ``decode_batch``."""
    return decode_batch(
        model, state, [selections], max_new_tokens=max_new_tokens, stop_ids=stop_ids, certify=certify,
        oracle=oracle, delta=delta, randomized=None if randomized is None else [randomized],
    )[0]


@dataclass(frozen=True)
class Configuration:
    """One compared configuration of a prompt: a policy, a design, a budget and a seed (the full cache has
    policy == design == "full")."""

    policy: str
    design: str
    budget: float
    seed: int

    @property
    def is_full(self) -> bool:
        return self.policy == FULL


def configuration_selections(
    state: Prefill,
    configuration: Configuration,
    *,
    item_id: str | None = None,
    options: DesignOptions = DesignOptions(),
    allocator: str = RUN.allocator,
    allocator_options: dict | None = None,
    target: Target | None = None,
    calibration=None,
) -> tuple[list[Selection] | None, pd.DataFrame | None]:
    """(per-layer Selections or None for the full cache, the target's choice log or None) of one configuration.

    item_id: the Poisson seed is derived from (seed, item_id) (``item_seed``); None: the seed itself. target: the
    Poisson design at the sizes the target chooses (the budget a cap), its certificate scaled by ``calibration``'s
    factors when given; otherwise ``select`` with the allocator.
    """
    if configuration.is_full:
        return None, None
    seed = configuration.seed if item_id is None else item_seed(configuration.seed, item_id)
    if configuration.design == "clt":
        return clt_selections(state, configuration.policy, configuration.budget, seed, options, target), None
    if target is None:
        return select(state, configuration.policy, configuration.design, configuration.budget, seed, options,
                      allocator, allocator_options), None
    scales = None if calibration is None else calibrated_scales(
        calibration, setting=state.setting, policy=configuration.policy, budget=configuration.budget,
        n_layers=len(state.cache.layers))
    return targeted_selections(state.layer_views(), state.scores(configuration.policy), target, configuration.budget,
                               options, seed, get_policy(configuration.policy).certain_top_slice, scales)


def clt_selections(state: Prefill, policy: str, budget: float, seed: int, options: DesignOptions,
                   target: Target | None) -> list[Selection]:
    """Design clt's per-layer selections: every slot kept, each layer's decode-time sampler drawing from the
    policy's scores against ``target`` (ε, δ), the sinks and recent window of ``options`` kept exactly, the draws
    per query capped at the context's token count (past it, attending to every token costs less than sampling;
    the budget does not apply: nothing is evicted); one generator seeded by ``seed`` for the row's layers.
    Without a target ``clt_design`` refuses (no sampler options)."""
    sampler_options = None if target is None else CLTOptions(
        epsilon=target.error, delta=target.delta, n_sink=options.n_sink, n_recent=options.n_recent, max_fraction=1.0)
    generator = torch.Generator().manual_seed(int(seed))
    return [clt_design(scores, budget, options, generator, sampler_options=sampler_options)
            for scores in state.scores(policy)]


def decode_configurations(
    model,
    state: Prefill,
    configurations: list[Configuration],
    *,
    item_id: str | None = None,
    max_new_tokens: int = 16,
    stop_ids: set[int] | None = None,
    certify: bool = True,
    oracle: bool = False,
    delta: float = RUN.delta,
    options: DesignOptions = DesignOptions(),
    allocator: str = RUN.allocator,
    allocator_options: dict | None = None,
    target: Target | None = None,
    calibration=None,
    decode_bound=None,
    policy_options: dict | None = None,
) -> list[Decoded]:
    """Several configurations of one prefilled prompt, decoded together: one Decoded per configuration, in order.

    The one decode path of ``generate`` (one configuration) and of the cell runner (a batch per budget):
    each configuration's selections (``configuration_selections``), one ``decode_batch``, then, given a
    calibration (loaded and checked: ``kvcert.calibration.prepare_calibration``), its calibrated certificate
    added to the compressed configurations' steps; with a target, each Decoded carries its ``target_choice``.
    decode_bound: a ``kvcert.decode_compression.DecodeBound`` (one compressed configuration): the cache is compressed
    again with the configuration's policy (its ``policy_options``) and design whenever decoding would exceed it.
    """
    compressor = None
    if decode_bound is not None:
        from .decode_compression import DecodeCompressor

        if len(configurations) != 1 or configurations[0].is_full:
            raise ValueError("max_cache_tokens: decode-time compression decodes one compressed configuration at a "
                             "time")
        conf = configurations[0]
        compressor = DecodeCompressor(
            decode_bound, policy=conf.policy, design=conf.design, options=options, policy_options=policy_options,
            seed=conf.seed if item_id is None else item_seed(conf.seed, item_id), observations=state.observations,
            window=state.observations[0].window)
    picked = [configuration_selections(state, conf, item_id=item_id, options=options, allocator=allocator,
                                       allocator_options=allocator_options, target=target, calibration=calibration)
              for conf in configurations]
    decoded = decode_batch(
        model, state, [selections for selections, _ in picked], max_new_tokens=max_new_tokens, stop_ids=stop_ids,
        certify=certify, oracle=oracle, delta=delta,
        randomized=[not conf.is_full and conf.design == "poisson" for conf in configurations], compressor=compressor,
    )
    for conf, out, (_, choice) in zip(configurations, decoded, picked):
        out.target_choice = choice
        if calibration is not None and not conf.is_full:
            from .calibration import apply_calibration

            out.steps = apply_calibration(calibration, out.steps, design=conf.design, policy=conf.policy,
                                          budget=conf.budget, setting=state.setting, checked=True)
    return decoded


DEFAULT_NEW_TOKENS = 16  # generate's answer length where neither the call nor the model's generation config sets one


def new_token_limit(model, max_new_tokens: int | None) -> int:
    """``max_new_tokens``, or (None) the model's ``generation_config.max_new_tokens``, else DEFAULT_NEW_TOKENS."""
    if max_new_tokens is not None:
        return int(max_new_tokens)
    configured = getattr(getattr(model, "generation_config", None), "max_new_tokens", None)
    return int(configured) if configured is not None else DEFAULT_NEW_TOKENS


@dataclass
class GenerationResult(Decoded):
    """``Decoded`` plus the prompt's token counts and the configuration that produced it."""

    policy: str = FULL
    design: str = FULL
    budget: float = 1.0
    seed: int = 0
    setting: str = "question_aware"
    context_tokens: int = 0
    allocator: str = RUN.allocator


def generate(
    model,
    tokenizer,
    *,
    context: str,
    question: str,
    answer_prefix: str = "",
    policy: str = RUN.policies[0],
    design: str = RUN.designs[-1],
    budget: float = RUN.budgets[0],
    setting: str = RUN.setting,
    seed: int = RUN.seeds[0],
    item_id: str | None = None,
    oracle: bool = False,
    certify: bool = RUN.certify,
    max_new_tokens: int | None = None,
    delta: float = RUN.delta,
    observation_window: int = RUN.observation_window,
    options: DesignOptions = DesignOptions(),
    policy_options: dict | None = None,
    max_context_tokens: int | None = RUN.max_context_tokens,
    truncate: str = RUN.truncate,
    chat_template: bool = RUN.chat_template,
    calibration=None,
    allocator: str = RUN.allocator,
    allocator_options: dict | None = None,
    target_error: float | None = None,
    target_delta: float | None = None,
    target_floor: float | str | None = RUN.target_floor,
    max_cache_tokens: int | None = None,
    compression_interval: int | None = None,
) -> GenerationResult:
    """Generate an answer to ``question`` about ``context`` on a compressed cache, with certificates.

    The prompt is built as the cell runner builds it (``kvcert.prompts.build_prompt``: ``answer_prefix``
    opens the answer, a prompt longer than the model's window or ``max_context_tokens`` is cut in the
    middle of its context; ``chat_template=True`` frames it with the tokenizer's chat template as kvpress
    does: the context opens a user turn, the question closes it, the assistant's turn follows), so that for the
    same item and configuration ``generate`` returns the prediction ``kvcert-run`` records. policy/design: registered names (``policy="full"`` keeps the whole
    cache); budget: retained fraction of the prefix in (0, 1]; setting: ``question_aware`` (compress
    after context + question) or ``streaming`` (compress the context; question and answer attend to the
    compressed cache); seed: the Poisson draw, derived per item as the runner does when ``item_id`` is
    given; calibration: a ``kvcert.calibration.Calibration``, a path to one (``kvcert-calibrate``), or
    ``"design"`` (the data-free correction), which adds the calibrated certificate to ``steps``
    (``cert_calibrated``, and ``coverage_calibrated`` with the oracle); a file fitted on another model or
    other design knobs raises ``CalibrationError``; allocator / allocator_options: how many slots each
    (layer, KV head) keeps (``select``; a calibration is fitted under the uniform allocator only);
    target_error, target_delta: a target relative error ε at
    level δ (default ``delta``) for design ``poisson``, the budget being its cap (``kvcert.targets``): per layer
    and KV head the smallest expected sample whose certificate (the calibrated one, given a calibration file),
    predicted on the observation window's queries, is within ε; the choice is ``target_choice``. Pairs that
    miss ε even at the cap keep the cap, and a ``TargetNotMetWarning`` says how many; target_floor: what every KV
    head keeps at least, the target choosing only what it adds: ``"half_cap"`` (the default, half of ``budget``), a
    fraction of the prefix (at most ``budget``), or None (no floor). max_cache_tokens / compression_interval:
    compression during long generations (``kvcert.decode_compression``): no (layer, KV head) holds more than
    ``max_cache_tokens`` slots while decoding, the cache being compressed again with the same policy and design
    (the certificate with the stages' compound π) whenever the next pass would exceed it, to an expected
    ``max_cache_tokens − compression_interval``; the result's ``peak_cache_tokens`` and ``decode_compressions``
    say what happened. None (the default): compressed once, after the prefill. options: the design's knobs
    (``kvcert.DesignOptions``), among them the certificate's two defenses for design poisson, ``tail_mix`` (a
    uniform share of the tail's π) and ``head_attention_share`` (a share of the certain head given to the tokens
    the observation window attends to most); both 0 by default.

    Defaults serve, not study: no oracle unless ``oracle=True`` (the oracle keeps the full prefix and measures the
    true error), the model as it is (its own dtype and device), and ``max_new_tokens=None`` takes the model's
    ``generation_config.max_new_tokens`` (``DEFAULT_NEW_TOKENS`` where it sets none). The cell runner passes the
    study's own values of each.
    """
    max_new_tokens = new_token_limit(model, max_new_tokens)
    decode_bound = None
    if max_cache_tokens is not None or compression_interval is not None:
        from .decode_compression import check_decode_bound

        if policy == FULL:
            raise ValueError(f"max_cache_tokens={max_cache_tokens!r} with policy='full': decode-time compression "
                             "re-applies a compressing policy (for no compression at the prefill: budget=1.0)")
        decode_bound = check_decode_bound(max_cache_tokens, compression_interval, policy=policy, design=design,
                                          options=options, policy_options=policy_options, who="kvcert.generate")
    target = None if policy == FULL else check_target(design, target_error, target_delta, target_floor)
    if policy != FULL:  # options.tail_mix / head_attention_share: design poisson only, each in [0, 1]
        check_design_defenses(design, options, who="kvcert.generate")
    floor = None if target is None else target.floor_at(budget)
    if floor is not None and floor > budget:
        raise ValueError(f"target_floor={floor:g} exceeds the cap budget={budget:g}: the floor must not exceed "
                         "the cap")
    prompt = build_prompt(tokenizer, context, question, answer_prefix, setting=setting,
                          max_new_tokens=max_new_tokens, limit=model_limit(model, max_context_tokens),
                          truncate=truncate, chat_template=chat_template)
    fed_at_once = prompt.suffix_ids.shape[-1]
    if decode_bound is not None and decode_bound.target(fed_at_once) <= options.n_sink + options.n_recent:
        raise ValueError(f"kvcert.generate: max_cache_tokens={decode_bound.max_cache_tokens} leaves no room for the "
                         f"question's {fed_at_once} tokens beyond n_sink={options.n_sink} + "
                         f"n_recent={options.n_recent} (setting={setting!r} feeds them at once)")
    full = policy == FULL
    get_allocator(allocator, **(allocator_options or {}))  # a bad name or option is refused before the prefill
    if target is not None and allocator != "uniform":
        raise ValueError(f"allocator={allocator!r}: a target chooses each KV head's sample size itself; drop "
                         "target_error or the allocator")
    if calibration is not None and not full and allocator != "uniform":
        raise ValueError(f"allocator={allocator!r}: a calibration's factors were fitted under the uniform allocator")
    if calibration is not None and not full:  # refused before anything is computed
        from .calibration import prepare_calibration

        calibration = prepare_calibration(calibration, model=model, setting=setting,
                                          configurations=[(policy, design, budget)], options=options, delta=delta,
                                          observation_window=observation_window, policy_options=policy_options)
    needs = prefill_needs([] if full else [policy], policy_options)
    state = prefill(model, prompt.prefix_ids, prompt.suffix_ids, setting=setting,
                    observation_window=observation_window, **needs, policy_options=policy_options)
    configuration = Configuration(FULL, FULL, 1.0, seed) if full else Configuration(policy, design, budget, seed)
    decoded, = decode_configurations(
        model, state, [configuration], item_id=item_id, max_new_tokens=max_new_tokens,
        stop_ids=eos_ids(model, tokenizer), certify=certify, oracle=oracle, delta=delta, options=options,
        allocator=allocator, allocator_options=allocator_options, target=target,
        calibration=None if full else calibration, decode_bound=decode_bound, policy_options=policy_options,
    )
    if decoded.target_choice is not None and (message := cap_binding_message(decoded.target_choice, target, budget)):
        warnings.warn(message, TargetNotMetWarning, stacklevel=2)
    fields = {k: getattr(decoded, k) for k in Decoded.__dataclass_fields__}
    fields["text"] = tokenizer.decode(decoded.token_ids, skip_special_tokens=True)
    return GenerationResult(
        **fields, policy=policy, design=FULL if full else design, budget=1.0 if full else budget, seed=seed,
        setting=setting, context_tokens=state.context_tokens, allocator=allocator,
    )

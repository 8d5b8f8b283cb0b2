"""Compression during long generations: when the generated tokens grow a compressed cache past a bound, the
cache is compressed again with the same design, so that memory stays bounded however long the answer.

The bound: ``max_cache_tokens`` (B) is the most slots any (layer, KV head) holds during decoding, a hard bound
(what memory planning needs; the cache's buffers are allocated at B slots and never grow past it).
``compression_interval`` (I) is how many tokens may be appended between two compressions: a compression aims at
an expected B − I slots (kvpress's ``DecodingPress`` names the pair ``token_buffer_size`` and
``compression_steps``, but its buffer is the size after a compression, so its cache peaks at buffer + steps; here
the peak itself is the option). Before a forward pass of m tokens, each layer whose filled slots plus m would
exceed B is compressed, aiming at min(B − I, B − m) slots; a Poisson draw that still leaves more than B − m (a draw
above its expectation by the interval) is thinned once more at once, so the bound holds for every draw. The
interval's default, ``default_interval``, is a quarter of the room beyond the sinks and the recent window.

What a compression does, per layer and KV head (``thin_head``): the head's retained slots, ordered by position,
form a population of n slots; the press's policy scores them from the keys, values and the queries of the last
tokens (``LayerView``: the window queries are those of the last ``observation_window`` tokens fed, at most the
recent window, whose slots are always cached); the same design as at the prefill keeps them: ``topk`` the sinks,
the recent window and the top of the ranking up to B − I slots; ``poisson`` the sinks, the recent window and a
top slice (``head_fraction``) with conditional probability 1 and the tail with probabilities ∝ score, Σ = B − I
(``kvcert.sampling.inclusion_probabilities``, one Poisson draw each). For the Poisson design a slot's score is
the policy's score times 1/π of its earlier stages, the number of tokens it stands for, so that a slot that already
carries a large Hájek weight is rarely thinned again (for attention-based scores this is the attention the slot's
weight receives under the Hájek offset). Scores only choose the probabilities: any choice computed from what the
decoding has seen keeps the estimator valid (below). Scores are computed per KV head (a policy that averages over
all heads, TOVA's ``heads="all"``, averages over the head's query group here) and ignore a layer's sliding
window beyond the slots' order; policies that need what only a prefill collects (accumulated attention, query
statistics, keys before RoPE) are refused.

The statistics. A slot retained at the prefill with probability π₁ (1 for the certain head and every generated
token) and kept by a later compression with conditional probability π₂ (given everything drawn before; the stages'
uniform draws are independent) was retained with total probability π₁·π₂ in the sense that matters: the weight
1/(π₁π₂) makes the Horvitz-Thompson total unbiased, because the compression's draw is unbiased for the stage-one
total given the stage-one sample, Σ_{S₂} y/(π₁π₂) having conditional mean Σ_{S₁} y/π₁ (two-phase sampling). So
the logit offset after k compressions is −log(π₁π₂⋯π_k) and the slot's log π in the cache is the sum of its
stages' log π (``compound_log_pi``, added in float64, stored as float32). The certificate keeps its form with the
compound π: the survey variance estimator Σ_{S} (1 − π)/π² y² with π the compound probability has conditional mean
Σ_{S₁} (1 − π₁)/π₁² y² + Σ_{S₁} (1 − π₂)/(π₁²π₂) y² given S₁, the stage-one estimator plus the compression's own
variance, so it stays unbiased for the variance of the two-stage total; the same holds stage by stage for every
further compression, and for the decision to thin once more (it depends on the draws before only). The Hájek
linearization then applies to the final sample as at the prefill (docs/METHOD.md §4), and the certificate covers
the tokens that were sampled; as at the prefill it is conditional on the queries, which earlier draws influence.
Every draw comes from one generator per decoding, seeded from the configuration's seed apart from the prefill's
stream (``decode_seed``).

The oracle (``oracle=True``) keeps every token: at each compression the tokens generated since the last one join
its uncompressed prefix, so the true error is still measured against the full cache.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

from .allocators import LayerBudget
from .cache import CompressedCache, CompressedLayer
from .designs import poisson_design, topk_design, window_attention_mass
from .estimator import offset_bias, sampled_slots
from .policies import LayerView, get_policy
from .run_schema import DesignOptions

DECODE_DESIGNS = ("poisson", "topk")
MAX_THINNINGS = 32  # further stages in a row before giving up (each one is a fresh draw; reached only by a bug)


def default_interval(max_cache_tokens: int, options: DesignOptions) -> int:
    """A quarter of the room beyond the sinks and the recent window (at least 1)."""
    return max(1, (max_cache_tokens - options.n_sink - options.n_recent) // 4)


@dataclass(frozen=True)
class DecodeBound:
    """The decode-time bound: at most ``max_cache_tokens`` slots per (layer, KV head) while decoding, compressed to
    an expected ``max_cache_tokens − compression_interval`` whenever the next pass would exceed it."""

    max_cache_tokens: int
    compression_interval: int

    def target(self, m: int) -> int:
        """The expected slots a compression before a pass of ``m`` tokens aims at."""
        return min(self.max_cache_tokens - self.compression_interval, self.max_cache_tokens - m)


def check_decode_bound(max_cache_tokens, compression_interval, *, policy: str, design: str, options: DesignOptions,
                       policy_options: dict | None = None, who: str = "kvcert") -> DecodeBound | None:
    """The DecodeBound of the options (None: no decode-time compression), or a one-line ValueError naming the
    option and its values: a bound at or below the slots every compression keeps (sinks + recent window) plus the
    interval, an interval below 1, a design other than poisson/topk, or a policy that needs a prefill's
    observations. ``compression_interval`` without ``max_cache_tokens`` is refused too."""
    if max_cache_tokens is None:
        if compression_interval is not None:
            raise ValueError(f"{who}: compression_interval={compression_interval!r} needs max_cache_tokens (the bound "
                             "it compresses to)")
        return None
    if isinstance(max_cache_tokens, bool) or not isinstance(max_cache_tokens, int):
        raise ValueError(f"{who}: max_cache_tokens={max_cache_tokens!r} must be an integer (slots per layer and KV "
                         "head)")
    if compression_interval is None:
        compression_interval = default_interval(max_cache_tokens, options)
    if isinstance(compression_interval, bool) or not isinstance(compression_interval, int) or compression_interval < 1:
        raise ValueError(f"{who}: compression_interval={compression_interval!r} must be an integer >= 1")
    certain = options.n_sink + options.n_recent
    if max_cache_tokens <= certain + compression_interval:
        raise ValueError(
            f"{who}: max_cache_tokens={max_cache_tokens} is at or below the certain slots plus the interval: n_sink="
            f"{options.n_sink} + n_recent={options.n_recent} + compression_interval={compression_interval} = "
            f"{certain + compression_interval} (a compression keeps those and needs room for the certain head and "
            "the tail); raise max_cache_tokens or lower compression_interval")
    if design not in DECODE_DESIGNS:
        raise ValueError(f"{who}: max_cache_tokens with design={design!r}: decode-time compression re-applies "
                         f"{' or '.join(DECODE_DESIGNS)}")
    chosen = get_policy(policy, **(policy_options or {}).get(policy, {}))
    needs = [name for name in ("needs_accumulated_attention", "needs_query_statistics", "needs_pre_rope_keys")
             if getattr(chosen, name)]
    if needs:
        raise ValueError(f"{who}: max_cache_tokens with policy={policy!r}: it scores with what only a prefill "
                         f"collects ({', '.join(n.removeprefix('needs_') for n in needs)}); decode-time compression "
                         "needs a policy that reads keys, values and window queries (e.g. snapkv, tova, knorm, "
                         "keydiff, streamingllm)")
    return DecodeBound(max_cache_tokens, compression_interval)


def decode_seed(seed: int) -> int:
    """The seed of a decoding's compression draws, apart from the prefill's stream of ``seed``."""
    return zlib.crc32(f"{seed}:decode-compression".encode()) & 0x7FFFFFFF


def compound_log_pi(earlier: torch.Tensor, stage: torch.Tensor) -> torch.Tensor:
    """log π of the stages so far plus log π of this one: log(π₁·π₂), added in float64, returned float32.

    earlier, stage: (..., k) log π ≤ 0 (0: certain), any float dtype."""
    return (earlier.to(torch.float64) + stage.to(torch.float64)).to(torch.float32)


@dataclass(frozen=True)
class Thinning:
    """One compression of one layer, as ``recording_thinnings`` logs it: length, the cache's logical length;
    positions (kv_heads, k) long, the kept slots' positions (−1: padding); stage_log_pi (kv_heads, k) float32,
    their conditional log π in this compression; log_pi (kv_heads, k) float32, their compound log π."""

    layer: int
    length: int
    positions: torch.Tensor
    stage_log_pi: torch.Tensor
    log_pi: torch.Tensor


_THINNINGS: ContextVar[list | None] = ContextVar("thinnings", default=None)


@contextmanager
def recording_thinnings() -> Iterator[list[Thinning]]:
    """Collect a ``Thinning`` for every decode-time compression made inside (in order)."""
    token = _THINNINGS.set([])
    try:
        yield _THINNINGS.get()
    finally:
        _THINNINGS.reset(token)


def thin_head(view: LayerView, log_pi: torch.Tensor, target: int, *, policy, design: str, options: DesignOptions,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head's compression: (kept indices (k,) ascending into the head's n slots, their conditional log π
    (k,) float32).

    view: the head's slots ordered by position, keys/values (1, 1, n, d), window_queries (1, group, w, d) of its
    query heads; log_pi: (n,) the slots' compound log π so far; target: the expected kept count (topk: the count).
    A head with at most ``target`` slots (a layer's heads differ in count) keeps them all, π = 1, drawing nothing.
    """
    n = view.keys.shape[-2]
    if n <= target:
        return torch.arange(n, device=log_pi.device), torch.zeros(n, dtype=torch.float32, device=log_pi.device)
    scores = policy.score(view, generator).to(torch.float64)  # (1, 1, n)
    if design == "poisson":
        scores = scores * torch.exp(-log_pi.to(torch.float64)).to(scores.device)  # tokens each slot stands for
        design_fn = poisson_design
    else:
        design_fn = topk_design
    attended = design == "poisson" and options.head_attention_share > 0  # the defense's window attention
    selection = design_fn(scores, 1.0, options, generator=generator, certain_top_slice=policy.certain_top_slice,
                          allocation=LayerBudget(int(target)),
                          **({"attention": window_attention_mass(view)} if attended else {}))
    kept = torch.isfinite(selection.log_pi[0, 0])
    return selection.index[0, 0][kept], selection.log_pi[0, 0][kept]


class DecodeCompressor:
    """Keeps one decoding's cache under its DecodeBound: ``observe`` records each compressed layer's queries (the
    attention function calls it), ``before_pass`` compresses the layers the next pass would push past the bound.

    policy / policy_options / design / options: the configuration's; seed: its (item) seed; window: the window
    queries' length (the prefill's observation window, at most n_recent); observations: the prefill's
    ``Observation``s, whose window queries, scale, sliding window and output projection seed each layer's record.
    One batch row (one configuration) per decoding.
    """

    def __init__(self, bound: DecodeBound, *, policy: str, design: str, options: DesignOptions, seed: int,
                 policy_options: dict | None, observations, window: int):
        self.bound, self.design, self.options = bound, design, options
        self.policy = get_policy(policy, **(policy_options or {}).get(policy, {}))
        self.generator = torch.Generator().manual_seed(decode_seed(seed))
        self.window = max(1, min(window, options.n_recent))
        self.observations = observations
        self.queries = [obs.window_queries for obs in observations]  # per layer (1, q_heads, ≤ window, d)
        self.compressions = 0  # layer compressions (a further thinning counts again)
        self.peak = 0  # the most slots a layer held after a pass (every layer and KV head)
        self._extended_oracle = False

    def observe(self, layer_idx: int, query: torch.Tensor) -> None:
        """Record a compressed layer's post-RoPE queries (1, q_heads, m, d) (the last ``window`` are kept)."""
        known = self.queries[layer_idx]
        joined = query.detach() if known is None else torch.cat([known, query.detach()], dim=-2)
        self.queries[layer_idx] = joined[..., -self.window:, :].clone()

    def before_pass(self, context, m: int) -> None:
        """Before a forward pass of ``m`` tokens on ``context.cache``: compress every layer that would exceed the
        bound (once more while a draw leaves too many slots), then note the slots the pass will leave."""
        bound = self.bound.max_cache_tokens
        if context.cache.layers[0].keys.shape[0] != 1:
            raise ValueError("decode-time compression decodes one configuration (one batch row) at a time")
        for i, layer in enumerate(context.cache.layers):
            thinnings = 0
            while layer.filled + m > bound:
                if thinnings == MAX_THINNINGS:
                    raise RuntimeError(f"layer {i}: {MAX_THINNINGS} compressions in a row left {layer.filled} slots "
                                       f"above max_cache_tokens={bound} - {m}")
                self._compress(context, i, self.bound.target(m))
                thinnings += 1
            self.peak = max(self.peak, layer.filled + m)

    def _compress(self, context, i: int, target: int) -> None:
        layer: CompressedLayer = context.cache.layers[i]
        if context.oracle is not None:
            self._extend_oracle(context, i, layer)
        obs = self.observations[i]
        queries = self.queries[i]
        h = layer.keys.shape[1]
        group = queries.shape[1] // h
        valid = torch.isfinite(layer.log_pi[0])  # (h, F)
        big = torch.iinfo(torch.long).max
        order = torch.argsort(torch.where(valid, layer.positions[0], torch.full_like(layer.positions[0], big)), dim=-1)
        kept_rows = []
        for g in range(h):
            n = int(valid[g].sum())
            idx = order[g, :n]
            keys, values = layer.keys[0, g, idx], layer.values[0, g, idx]
            projection = obs.output_projection
            if projection is not None:
                d = queries.shape[-1]
                projection = projection[:, g * group * d:(g + 1) * group * d]
            view = LayerView(keys=keys[None, None], values=values[None, None],
                             window_queries=queries[:, g * group:(g + 1) * group], accumulated_attention=None,
                             scale=obs.scale, sliding_window=obs.sliding_window, output_projection=projection)
            local, stage = thin_head(view, layer.log_pi[0, g, idx], target, policy=self.policy, design=self.design,
                                     options=self.options, generator=self.generator)
            slots = idx[local.to(idx.device)]
            kept_rows.append((slots, stage.to(layer.log_pi.device)))
        stage = self._rebuild(layer, kept_rows)
        context._tails.pop(i, None)  # the retained set changed: 1 − π is read anew
        self.compressions += 1
        log = _THINNINGS.get()
        if log is not None:
            log_pi = layer.log_pi[0].detach().cpu().clone()
            positions = torch.where(torch.isfinite(log_pi), layer.positions[0].cpu(), -1)
            log.append(Thinning(i, layer.length, positions, stage[0].cpu(), log_pi))

    def _rebuild(self, layer: CompressedLayer, kept_rows: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Replace the layer's slots by each head's kept ones (slot indices, conditional log π), with their compound
        log π, sampled first, padded to the longest head with log π = −inf, in buffers of max_cache_tokens slots.
        Returns the kept slots' conditional log π (1, kv_heads, k) in the new order."""
        k_max = max(len(slots) for slots, _ in kept_rows)
        h = len(kept_rows)
        device = layer.keys.device
        index = torch.zeros((1, h, k_max), dtype=torch.long, device=device)
        stage = torch.full((1, h, k_max), float("-inf"), dtype=torch.float32, device=device)
        log_pi = torch.full((1, h, k_max), float("-inf"), dtype=torch.float32, device=device)
        for g, (slots, stage_g) in enumerate(kept_rows):
            index[0, g, :len(slots)] = slots
            stage[0, g, :len(slots)] = stage_g
            log_pi[0, g, :len(slots)] = compound_log_pi(layer.log_pi[0, g, slots], stage_g)
        order = torch.argsort((~sampled_slots(log_pi)).to(torch.uint8), dim=-1, stable=True)
        index, stage, log_pi = index.gather(-1, order), stage.gather(-1, order), log_pi.gather(-1, order)
        gather4 = lambda t: t.gather(2, index.unsqueeze(-1).expand(*index.shape, t.shape[-1]))  # noqa: E731
        keys, values = gather4(layer.keys), gather4(layer.values)
        positions = layer.positions.gather(2, index)
        layer._allocate(keys, values, log_pi, offset_bias(log_pi), positions,
                        max(self.bound.max_cache_tokens, k_max))
        layer.n_prefix_slots = k_max  # slots after it are appended tokens (the oracle holds every earlier one)
        layer.n_sampled_slots = int(sampled_slots(log_pi).sum(-1).max())
        layer.compressed = True
        return stage

    def _extend_oracle(self, context, i: int, layer: CompressedLayer) -> None:
        """The oracle's uncompressed layer i plus the tokens appended since the last compression (in order), in a
        cache of its own (the prefill's cache, shared with other decodings, is left untouched)."""
        if not self._extended_oracle:
            context.oracle = CompressedCache(list(context.oracle.layers))
            self._extended_oracle = True
        old = context.oracle.layers[i]
        k0 = layer.n_prefix_slots
        extended = CompressedLayer()
        extended.device, extended.is_initialized = old.device, True
        extended._allocate(torch.cat([old.keys, layer.keys[:, :, k0:]], dim=2),
                           torch.cat([old.values, layer.values[:, :, k0:]], dim=2),
                           torch.cat([old.log_pi, layer.log_pi[:, :, k0:]], dim=2),
                           torch.cat([old.offset, layer.offset[:, :, k0:]], dim=2),
                           torch.cat([old.positions, layer.positions[:, :, k0:]], dim=2), 0)
        extended.length = extended.filled
        context.oracle.layers[i] = extended


__all__ = ["DECODE_DESIGNS", "DecodeBound", "DecodeCompressor", "Thinning", "check_decode_bound", "compound_log_pi",
           "decode_seed", "default_interval", "recording_thinnings", "thin_head"]

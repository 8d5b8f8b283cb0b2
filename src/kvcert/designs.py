"""Designs: how a policy's scores become a retained set per layer and KV head.

``topk`` keeps the sinks, the recent window and the top of the score ranking (deterministic eviction).
``poisson`` keeps a certainty head with π = 1 and Poisson-samples the tail with known π; the retained
tokens carry log π so that attention can apply the Hájek offset −log π. ``clt`` is the peers' baseline: it
keeps every slot and samples at decode time (``kvcert.peer_sampling``), so it needs a target (ε, δ). How many slots each KV head keeps
is an allocator's ``LayerBudget`` (kvcert.allocators; by default ``retained_count(budget, n)`` per head); a
pooled budget is ranked (top-k) or sampled (Poisson, Σπ = kv_heads · count) across the layer's KV heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .run_schema import DesignOptions  # the run schema's design_options, defined there once
from .estimator import sampled_slots
from .peer_sampling import CLTOptions, DecodeSampler
from .sampling import certain_mask, check_defenses, inclusion_probabilities, poisson_sample, retained_count
from .seeding import generator_or_seeded_zero

if TYPE_CHECKING:  # designs read an allocation's fields only: kvcert.allocators sits beside them, not below
    from .allocators import LayerBudget
    from .policies.base import LayerView

# topk_design breaks ties by adding up to TIE_JITTER times the head's largest score, a seeded uniform draw per
# token: small enough to reorder only (near-)equal scores, large enough to survive float64 rounding.
TIE_JITTER = 1e-9


@dataclass(frozen=True)
class Selection:
    """Retained slots of one layer.

    index: (batch, kv_heads, k) long, positions into the prefix, ascending among valid slots;
    log_pi: (batch, kv_heads, k) float32: 0 certain, log π sampled, −inf padding (rows differ in count).
    """

    index: torch.Tensor
    log_pi: torch.Tensor
    sampler: DecodeSampler | None = None  # design clt: the decode-time sampler of this layer (every slot kept)

    @property
    def retained(self) -> torch.Tensor:
        """(batch, kv_heads) number of retained (non-padding) slots."""
        return torch.isfinite(self.log_pi).sum(-1)

    @property
    def has_tail(self) -> bool:
        """Whether some retained slot was sampled (π < 1): the design then has a certificate."""
        return bool(sampled_slots(self.log_pi).any())


def defended(options: DesignOptions) -> bool:
    """Whether either defense of the certificate is on (``tail_mix`` or ``head_attention_share`` above 0)."""
    return options.tail_mix != 0 or options.head_attention_share != 0


def check_design_defenses(design: str, options: DesignOptions, who: str = "kvcert") -> None:
    """One ValueError line for a defense outside [0, 1], or for one that is on with a design other than poisson
    (top-k has no sampled tail and no π; clt keeps every slot)."""
    try:
        check_defenses(options.tail_mix, options.head_attention_share)
    except ValueError as err:
        raise ValueError(f"{who}: {err}") from None
    if design != "poisson" and defended(options):
        name, value = (("tail_mix", options.tail_mix) if options.tail_mix != 0
                       else ("head_attention_share", options.head_attention_share))
        raise ValueError(f"{who}: design_options.{name}={value} applies to design 'poisson' (a sampled tail with "
                         f"known pi); design {design!r} has none: set it to 0 or use design poisson")


def window_attention_mass(view: LayerView) -> torch.Tensor:
    """(batch, kv_heads, n) float32: the attention the observation window's queries pay each token, averaged over
    the window's queries and then over the query heads of each KV head (GQA), as SnapKV's scores before their
    pooling (``LayerView.window_attention``). In streaming the window is the context's last window."""
    return view.group_mean(view.window_attention().mean(dim=2))


def _pack(keep: torch.Tensor, log_pi_full: torch.Tensor) -> Selection:
    """Move kept positions (ascending) to the front of each row; pad to the longest row with −inf."""
    n = keep.shape[-1]
    positions = torch.arange(n, device=keep.device).expand_as(keep)
    # Kept slots sort before dropped ones; within each group, by position.
    order = torch.argsort(torch.where(keep, positions, positions + n), dim=-1)
    counts = keep.sum(-1)
    k_max = int(counts.max())
    index = order[..., :k_max]
    valid = torch.arange(k_max, device=keep.device) < counts.unsqueeze(-1)
    log_pi = torch.where(valid, log_pi_full.gather(-1, index), torch.full_like(index, float("-inf"), dtype=torch.float32))
    return Selection(index=index, log_pi=log_pi.to(torch.float32))


def _own_slots(ranked: torch.Tensor, certain: torch.Tensor, safeguard: int) -> torch.Tensor:
    """(batch, kv_heads, n) bool: each head's certain slots and its ``safeguard`` top-ranked ones (a pooled
    budget's per-head share, kept whatever the other heads rank)."""
    own = certain.clone()
    if safeguard > 0:
        top = torch.where(certain, torch.full_like(ranked, float("inf")), ranked)
        own.scatter_(-1, torch.topk(top, min(safeguard, ranked.shape[-1]), dim=-1).indices, True)
    return own


def topk_design(scores: torch.Tensor, budget: float, options: DesignOptions, generator=None, certain_top_slice=True,
                allocation: LayerBudget | None = None):
    """Keep sinks, recent window and the highest scores up to round(budget·n) tokens; π = 1 everywhere.

    scores: (batch, kv_heads, n); ties are broken by a seeded random jitter (no generator: one seeded 0).
    allocation: the count per head instead of round(budget·n); pooled: the kv_heads · count highest across the
    layer's heads, each head keeping its certain slots and its top ``allocation.safeguard`` (per-head counts then
    differ). The defenses (options.tail_mix, head_attention_share) are refused: top-k has no sampled tail.
    """
    check_design_defenses("topk", options)
    n = scores.shape[-1]
    count = allocation.count if allocation is not None else retained_count(budget, n, options.n_sink, options.n_recent)
    certain = certain_mask(n, options.n_sink, options.n_recent, scores.device).expand_as(scores)
    jitter = torch.rand(scores.shape, generator=generator_or_seeded_zero(generator), dtype=torch.float64)
    jitter = jitter.to(scores.device)
    ranked = scores.to(torch.float64) + TIE_JITTER * jitter * scores.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    ranked = torch.where(certain, torch.full_like(ranked, float("inf")), ranked)
    keep = torch.zeros_like(certain)
    if allocation is not None and allocation.pooled:
        b, h = scores.shape[:2]
        ranked = torch.where(_own_slots(ranked, certain, allocation.safeguard), float("inf"), ranked)
        flat = keep.reshape(b, h * n)
        flat.scatter_(-1, torch.topk(ranked.reshape(b, h * n), min(h * count, h * n), dim=-1).indices, True)
        keep = flat.reshape(b, h, n)
    else:
        keep.scatter_(-1, torch.topk(ranked, count, dim=-1).indices, True)
    return _pack(keep, torch.zeros(scores.shape, dtype=torch.float32, device=scores.device))


def poisson_design(scores: torch.Tensor, budget: float, options: DesignOptions, generator=None, certain_top_slice=True,
                   allocation: LayerBudget | None = None, *, attention: torch.Tensor | None = None):
    """Certain head with π = 1, Poisson tail with π ∝ score; Σπ = round(budget·n) per KV head.

    scores: (batch, kv_heads, n) non-negative importance. allocation: Σπ = allocation.count per head instead;
    pooled: one pool of the layer's heads, Σπ = kv_heads · count over it, each head's certain slots and top
    ``allocation.safeguard`` slots with π = 1, the top slice (head_fraction) and the tail across heads.
    attention: (batch, kv_heads, n) the window's attention (``window_attention_mass``), needed where
    options.head_attention_share gives the top slice slots (kvcert.sampling.inclusion_probabilities: the defenses).
    """
    defenses = {"tail_mix": options.tail_mix, "head_attention_share": options.head_attention_share,
                "attention": attention} if defended(options) else {}
    n = scores.shape[-1]
    count = allocation.count if allocation is not None else retained_count(budget, n, options.n_sink, options.n_recent)
    head_fraction = options.head_fraction if certain_top_slice else 0.0
    if allocation is not None and allocation.pooled:
        b, h = scores.shape[:2]
        certain = certain_mask(n, options.n_sink, options.n_recent, scores.device).expand_as(scores)
        own = _own_slots(scores.to(torch.float64), certain, allocation.safeguard)
        if defenses.get("attention") is not None:
            defenses["attention"] = attention.reshape(b, h * n)
        pi = inclusion_probabilities(scores.reshape(b, h * n), h * count, head_fraction=head_fraction,
                                     pi_min=options.pi_min, certain=own.reshape(b, h * n),
                                     **defenses).reshape(scores.shape)
    else:
        pi = inclusion_probabilities(
            scores,
            count,
            n_sink=options.n_sink,
            n_recent=options.n_recent,
            head_fraction=head_fraction,
            pi_min=options.pi_min,
            **defenses,
        )
    keep = poisson_sample(pi.cpu(), generator).to(scores.device)
    return _pack(keep, torch.log(pi))


# The one refusal of design clt without a target (kvcert.targets.check_target raises it for callers' keys).
CLT_NEEDS_TARGET = "design='clt' samples at decode time against a target: give target_error (and target_delta)"


def clt_design(scores: torch.Tensor, budget: float, options: DesignOptions, generator=None, certain_top_slice=True,
               allocation: LayerBudget | None = None, *, sampler_options: CLTOptions | None = None) -> Selection:
    """Keep every slot (π = 1) and estimate attention at decode time with a CLT-sized importance sample drawn anew
    for each query (vAttention, arXiv 2510.05688; ``kvcert.peer_sampling``): the peers' baseline, which frees no
    memory. scores: (1, kv_heads, n), the proposal; sampler_options: the target (ε, δ) and the sampler's knobs (its
    ``max_fraction`` caps the draws per query at that share of n; None: the budget's share)."""
    check_design_defenses("clt", options)
    if sampler_options is None:
        raise ValueError(CLT_NEEDS_TARGET)
    if allocation is not None and allocation.pooled:
        raise ValueError("design='clt' keeps every slot: an allocator has nothing to allocate")
    if scores.shape[0] != 1:
        raise ValueError(f"design='clt': scores {tuple(scores.shape)} must be one prompt's (1, kv_heads, n)")
    n = scores.shape[-1]
    if sampler_options.max_fraction is None:
        sampler_options = dataclasses.replace(sampler_options, max_fraction=budget)
    index = torch.arange(n, device=scores.device).expand(scores.shape).contiguous()
    sampler = DecodeSampler(sampler_options, scores[0].detach().float(), generator_or_seeded_zero(generator), n)
    return Selection(index=index, log_pi=torch.zeros(scores.shape, dtype=torch.float32, device=scores.device),
                     sampler=sampler)


DESIGNS: dict[str, Callable[..., Selection]] = {"topk": topk_design, "poisson": poisson_design, "clt": clt_design}
# Designs that draw at random (run once per seed) and those whose selection needs a target.
RANDOM_DESIGNS = ("poisson", "clt")
TARGET_DESIGNS = ("poisson", "clt")


def get_design(name: str) -> Callable[..., Selection]:
    if name not in DESIGNS:
        raise ValueError(f"design={name!r} is unknown; known: {sorted(DESIGNS)}")
    return DESIGNS[name]

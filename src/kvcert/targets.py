"""A budget as a target: the smallest expected Poisson sample whose certificate, predicted on the queries the
prefill observed, stays within a relative error ε (docs/library.md, "Targets").

For one layer and KV head h, the Poisson design with expected retained count m has inclusion probabilities
π(m) (``kvcert.sampling.inclusion_probabilities``: certain head, tail π ∝ score). The certificate a decode step
reports is ε̂_δ = sqrt(tr V̂ / δ), relative ε̂_δ / ‖ô‖, with V̂ = Σ_{i∈S} (1 − π_i) a_i² ‖v_i − ô‖² over the
retained set S (docs/METHOD.md §4). Before sampling, its expectation under Poisson sampling is, to first order
(a_i ≈ w_i/(π_i Σw) on S, P(i ∈ S) = π_i), the unconditional linearized variance

    tr V(m) = Σ_i (1 − π_i(m))/π_i(m) · a_i² ‖v_i − o‖²,      a = softmax of the full prefix, o its output,

which is computed here for each observation-window query (the last w prefix positions, causally masked as
they were observed), the query heads of a KV head pooled as the recorder pools them (traces add, norms are of
the concatenated outputs). The prediction for h is the ``quantile`` of sqrt(tr V(m)/δ)/‖o‖ over the window's
queries: by default the maximum (quantile 1), the conservative rule, fixed before any outcome was seen.

Each π_i(m) is non-decreasing in m (a larger count raises the water level; a token moving into the certain
top slice leaves its share to the others), so the prediction is non-increasing in m and the smallest m whose
prediction meets ε is found by bisection over integers in [sinks + recent window, cap], the cap being the
fractional budget's count. Where even the cap does not meet ε, the cap is kept and the choice says so.

What this promises: the prediction on the observed queries meets ε. Future queries (the answer's) may attend
differently; whether their certificates and errors stay within ε is measured, not assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .calibration import DESIGN as DESIGN_CORRECTION
from .calibration import ROUNDING, Calibration
from .run_schema import DELTA, FLOOR_SHARE_OF_CAP, HALF_CAP
from .designs import CLT_NEEDS_TARGET, TARGET_DESIGNS, DesignOptions, Selection, _pack, window_attention_mass
from .estimator import compute_dtype
from .policies.base import LayerView
from .sampling import Ranking, certain_mask, minimum_count, poisson_sample, rank_scores, retained_count
from .sampling import row_inclusion_probabilities as sampling_row_inclusion_probabilities

WINDOW_RULE_DEFAULT = 1.0  # the maximum over the window's queries


@dataclass(frozen=True)
class Target:
    """A target relative error ``error`` (ε, on ‖ô − o‖/‖o‖) at level ``delta`` (the certificate's δ), the
    rule aggregating the window's queries (``window_quantile`` in (0, 1], 1 = the maximum) and a ``floor`` that
    every KV head keeps at least, the target choosing only what it adds: ``HALF_CAP`` (the default: half of the
    budget the target is capped at, ``floor_at``), a fraction of the prefix in (0, 1], or None (no floor: the sinks
    + recent window are the only one, as every target before the default changed)."""

    error: float
    delta: float = DELTA
    window_quantile: float = WINDOW_RULE_DEFAULT
    floor: float | str | None = HALF_CAP

    def __post_init__(self):
        if not (isinstance(self.error, (int, float)) and math.isfinite(self.error) and self.error > 0):
            raise ValueError(f"target_error={self.error!r}: must be a number > 0")
        if not (isinstance(self.delta, (int, float)) and 0.0 < self.delta < 1.0):
            raise ValueError(f"target_delta={self.delta!r}: must lie in (0, 1)")
        if not 0.0 < self.window_quantile <= 1.0:
            raise ValueError(f"window_quantile={self.window_quantile!r}: must lie in (0, 1]")
        if self.floor is not None and self.floor != HALF_CAP and not (
                isinstance(self.floor, (int, float)) and not isinstance(self.floor, bool) and 0.0 < self.floor <= 1.0):
            raise ValueError(f"target_floor={self.floor!r}: must lie in (0, 1] (a fraction of the prefix), or be "
                             f"{HALF_CAP} (half the cap, the default) or null (no floor)")

    def floor_at(self, budget: float) -> float | None:
        """The floor as a fraction of the prefix under the cap ``budget`` (None: no floor)."""
        return FLOOR_SHARE_OF_CAP * budget if self.floor == HALF_CAP else self.floor


@dataclass(frozen=True)
class CalibratedScale:
    """One layer's calibrated certificate in relative form (docs/calibration.md, base ``paper``):

    calibrated = factor · (cert_weight · ε̂_rel + norm_weight), and at least ε̂_rel when never_below_paper.
    """

    factor: float
    cert_weight: float = 1.0
    norm_weight: float = 0.0
    never_below_paper: bool = True
    floor: float = 0.0  # the calibrated certificate's floor relative to ‖ô‖ (kvcert.calibration's ROUNDING)

    def apply(self, relative: torch.Tensor) -> torch.Tensor:
        """(...,) predicted ε̂_rel -> (...,) the calibrated certificate it stands for (monotone in ε̂_rel)."""
        calibrated = self.factor * (self.cert_weight * relative + self.norm_weight)
        if self.never_below_paper:
            calibrated = torch.maximum(calibrated, relative)
        return calibrated.clamp_min(self.floor)


def calibrated_scales(calibration, *, setting: str, policy: str, budget: float, n_layers: int,
                      check_only: bool = False) -> list[CalibratedScale | None]:
    """Per layer, the calibrated certificate of a calibration file's (setting, policy, poisson, budget) stratum
    (the budget being the target's cap), None for a layer without a factor (its paper certificate is used).

    calibration: a loaded ``kvcert.calibration.Calibration`` with base ``paper``; the data-free ``"design"``
    correction and base ``design`` depend on the realized sample (its tail_ess), which no prediction before
    sampling has, and are refused with one line. check_only: check that much and return [].
    """
    if calibration == DESIGN_CORRECTION or not isinstance(calibration, Calibration):
        raise ValueError(f"calibration={calibration!r}: a target is checked against a fitted calibration file only "
                         "(the data-free 'design' correction depends on the realized sample)")
    if calibration.base != "paper":
        raise ValueError(f"calibration={calibration.source}: base={calibration.base!r}; a target needs base 'paper' "
                         "(the design base depends on the realized sample)")
    if check_only:  # the file's kind only (a cell's validation, before the model and strata are known)
        return []
    stratum = calibration.stratum(setting, policy, "poisson", budget)
    if len(stratum["factors"]) < n_layers:
        raise ValueError(f"calibration={calibration.source} holds {len(stratum['factors'])} layers; the model has "
                         f"{n_layers}")
    return [None if f is None else CalibratedScale(float(f), float(cw), float(nw), calibration.never_below_paper,
                                                   ROUNDING)
            for f, cw, nw in zip(stratum["factors"], stratum["cert_weights"], stratum["norm_weights"])][:n_layers]


@dataclass(frozen=True)
class WindowTerms:
    """What the prediction needs of one layer, before any π: per (batch, kv_head, window query),

    weights: (batch, kv_heads, w, n) float64 (computed in float32 unless the inputs are float64), Σ over the KV
    head's query heads of a_i² ‖v_i − o‖²;
    out_norm_sq: (batch, kv_heads, w) float64, ‖o‖² of the concatenated outputs of those query heads.
    """

    weights: torch.Tensor
    out_norm_sq: torch.Tensor


@dataclass(frozen=True)
class TargetChoice:
    """The choice for one layer.

    expected_count: (batch, kv_heads) long, the chosen Σπ; cap_count: the budget's count (an int, the same for
    every head); n: prefix length; pi: (batch, kv_heads, n) float32, the design's π at the chosen count;
    predicted: (batch, kv_heads) float64, the predicted (calibrated, if given) relative certificate at the chosen
    count; met: (batch, kv_heads) bool, whether it is within ε (False only where the cap did not suffice).
    """

    expected_count: torch.Tensor
    cap_count: int
    n: int
    pi: torch.Tensor
    predicted: torch.Tensor
    met: torch.Tensor


def window_terms(view: LayerView) -> WindowTerms:
    """The prediction's π-free terms of one layer (see WindowTerms), from its keys/values (batch, kv_heads, n, d)
    and window queries (batch, q_heads, w, d), with the causal (and sliding-window) mask the window observed."""
    b, hq, w, d = view.window_queries.shape
    hk, n, group = view.keys.shape[1], view.n, view.group_size
    # float32 for a float32/bf16 cache (as the certificate itself is computed), float64 for float64 inputs
    dtype = compute_dtype(view.window_queries, view.keys, view.values)
    q = view.window_queries.to(dtype).reshape(b, hk, group, w, d)
    k = view.keys.to(dtype)
    v = view.values.to(dtype)
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q, k) * view.scale
    q_pos = torch.arange(n - w, n, device=k.device).unsqueeze(-1)
    k_pos = torch.arange(n, device=k.device)
    allowed = k_pos <= q_pos
    if view.sliding_window is not None:
        allowed &= k_pos > q_pos - view.sliding_window
    a = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # (b, hk, g, w, n)
    o = torch.einsum("bhgwn,bhnd->bhgwd", a, v)
    # ‖v_i − o‖² expanded; values centred on their mean first so the expansion keeps no large common offset
    center = v.mean(dim=-2, keepdim=True)
    vc, oc = v - center, o - center.unsqueeze(2)
    dist = ((vc.square().sum(-1)[:, :, None, None, :] - 2 * torch.einsum("bhnd,bhgwd->bhgwn", vc, oc)
             + oc.square().sum(-1).unsqueeze(-1)).clamp_min(0.0))
    return WindowTerms(weights=(a.square() * dist).sum(2).to(torch.float64),
                       out_norm_sq=o.square().sum((2, 4)).to(torch.float64))


def predicted_relative_certificate(terms: WindowTerms, pi: torch.Tensor, target: Target,
                                   calibration: CalibratedScale | None = None) -> torch.Tensor:
    """The predicted relative certificate per (batch, kv_head): (batch, kv_heads) float64.

    pi: (batch, kv_heads, n) in (0, 1]. Per window query sqrt(Σ_i (1−π_i)/π_i · weights_i / δ) / ‖o‖ (0 where
    both vanish), then calibrated (if given), then the target's quantile over the window's queries.
    """
    pi = pi.to(torch.float64)
    # π = 0 (a tail with no share: the count is the sinks + recent window) never retains a token: its term is
    # unbounded where the window attends to it and 0 where it does not (a sliding window's far keys), not NaN
    ratio = (1.0 - pi) / pi.clamp_min(1e-300)  # (b, hk, n)
    trace = torch.einsum("bhwn,bhn->bhw", terms.weights, ratio)
    cert = torch.sqrt(trace.clamp_min(0.0) / target.delta)
    norm = terms.out_norm_sq.sqrt()
    relative = torch.where(cert > 0, cert / norm, torch.zeros_like(cert))  # cert > 0 with ‖o‖ = 0 gives inf
    if calibration is not None:
        relative = calibration.apply(relative)
    if target.window_quantile >= 1.0:
        return relative.amax(-1)
    return torch.quantile(relative, target.window_quantile, dim=-1, interpolation="higher")


def row_inclusion_probabilities(scores: torch.Tensor, counts: torch.Tensor, options: DesignOptions,
                                certain_top_slice: bool = True, ranking: Ranking | None = None,
                                attention: torch.Tensor | None = None,
                                attention_ranking: Ranking | None = None) -> torch.Tensor:
    """``kvcert.sampling.row_inclusion_probabilities`` under a design's options (certain_top_slice False: no top
    slice, as a design without one): (..., n) float64 π, one expected count per row of ``counts`` (...)."""
    return sampling_row_inclusion_probabilities(
        scores, counts, n_sink=options.n_sink, n_recent=options.n_recent,
        head_fraction=options.head_fraction if certain_top_slice else 0.0, pi_min=options.pi_min,
        tail_mix=options.tail_mix, head_attention_share=options.head_attention_share, ranking=ranking,
        attention=attention, attention_ranking=attention_ranking)


def choose_expected_counts(view: LayerView, scores: torch.Tensor, target: Target, budget: float,
                           options: DesignOptions = DesignOptions(), certain_top_slice: bool = True,
                           calibration: CalibratedScale | None = None,
                           terms: WindowTerms | None = None, check: bool = True,
                           attention: torch.Tensor | None = None) -> TargetChoice:
    """The smallest expected count per (batch, kv_head) whose predicted certificate meets the target.

    view: the layer's prefill state (keys/values (batch, kv_heads, n, d), window queries (batch, q_heads, w, d));
    scores: (batch, kv_heads, n) the policy's importance; budget: the cap, a fraction in (0, 1];
    calibration: the layer's calibrated certificate, checked against the target instead of ε̂_rel; terms: the
    layer's window_terms when already computed (check=False: rows of several layers stacked, view only typed);
    attention: (batch, kv_heads, n) the window's attention where options.head_attention_share > 0 (None: the
    view's, ``kvcert.designs.window_attention_mass``).
    Bisection over integer counts in [sinks + recent window, retained_count(budget, n)] (the prediction is
    non-increasing in the count: see the module's docstring), the lower end raised to retained_count(floor, n)
    when the target has a floor (``Target.floor_at(budget)``; half the cap by default).
    """
    n = scores.shape[-1]
    if check and (scores.shape[:2] != view.keys.shape[:2] or n != view.n):
        raise ValueError(f"scores {tuple(scores.shape)} do not match the layer's keys {tuple(view.keys.shape)}")
    floor = target.floor_at(budget)
    if floor is not None and floor > budget:
        raise ValueError(f"target_floor={floor:g} exceeds the cap budget={budget:g}: the floor must not exceed "
                         "the cap")
    terms = terms if terms is not None else window_terms(view)
    cap = retained_count(budget, n, options.n_sink, options.n_recent)
    low = minimum_count(n, options.n_sink, options.n_recent)
    if floor is not None:  # every head keeps the uniform floor; the target decides only what is added
        low = max(low, retained_count(floor, n, options.n_sink, options.n_recent))
    shape = scores.shape[:-1]

    flat = scores.reshape(-1, n).to(torch.float64)
    certain = certain_mask(n, options.n_sink, options.n_recent, scores.device).expand_as(flat)
    ranking = rank_scores(flat, certain)
    attention_ranking = None
    if options.head_attention_share > 0:
        attention = attention if attention is not None else window_attention_mass(view)
        attention_ranking = rank_scores(attention.reshape(-1, n).to(torch.float64), certain)

    def predict(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pi = row_inclusion_probabilities(scores, counts, options, certain_top_slice, ranking, attention,
                                         attention_ranking)
        return pi, predicted_relative_certificate(terms, pi, target, calibration)

    lo = torch.full(shape, low, dtype=torch.long, device=scores.device)
    hi = torch.full(shape, cap, dtype=torch.long, device=scores.device)
    _, at_low = predict(lo)
    _, at_cap = predict(hi)
    # invariant for the rows still searching: the prediction at lo misses ε, the one at hi meets it
    hi = torch.where(at_low <= target.error, lo, hi)
    lo = torch.where(at_low <= target.error, lo - 1, lo)
    searching = (at_cap <= target.error) & (hi - lo > 1)
    while bool(searching.any()):
        mid = torch.where(searching, (lo + hi) // 2, hi)
        _, at_mid = predict(mid)
        meets = at_mid <= target.error
        hi = torch.where(searching & meets, mid, hi)
        lo = torch.where(searching & ~meets, mid, lo)
        searching = (at_cap <= target.error) & (hi - lo > 1)
    pi, predicted = predict(hi)
    return TargetChoice(expected_count=hi, cap_count=cap, n=n, pi=pi.to(torch.float32), predicted=predicted,
                        met=predicted <= target.error)


def target_design(view: LayerView, scores: torch.Tensor, target: Target, budget: float,
                  options: DesignOptions = DesignOptions(), generator: torch.Generator | None = None,
                  certain_top_slice: bool = True,
                  calibration: CalibratedScale | None = None) -> tuple[Selection, TargetChoice]:
    """The Poisson design at the targeted expected count: (Selection with index/log_pi (batch, kv_heads, k),
    the layer's TargetChoice). Draws from ``generator`` as ``poisson_design`` does (one draw per slot)."""
    choice = choose_expected_counts(view, scores, target, budget, options, certain_top_slice, calibration)
    keep = poisson_sample(choice.pi.cpu(), generator).to(scores.device)
    return _pack(keep, torch.log(choice.pi)), choice


class TargetNotMetWarning(UserWarning):
    """Some (layer, KV head) pairs' prediction exceeds ε even at the cap: they keep the cap (``met`` False)."""


def cap_binding_message(choice: pd.DataFrame, target: Target, budget: float) -> str | None:
    """One line naming how many (layer, KV head) pairs of a choice log (CHOICE_COLUMNS) keep the cap without
    meeting ε, or None where every pair meets it."""
    missed = int((~choice["met"].astype(bool)).sum())
    if missed == 0:
        return None
    return (f"target_error={target.error:g}: {missed} of {len(choice)} (layer, KV head) pairs are predicted above "
            f"it even at the cap budget={budget:g} and keep the cap (target_choice['met'] is False there); "
            "budget=1.0 lifts the cap")


# The per-(layer, KV head) log of a targeted selection (GenerationResult.target_choice; a target cell's
# targets.parquet adds the run's KEY_COLUMNS).
CHOICE_COLUMNS = ["layer", "kv_head", "expected_count", "cap_count", "context_tokens", "retained", "predicted_rel_cert",
                  "met"]


def targeted_selections(views: list[LayerView], scores: list[torch.Tensor], target: Target, budget: float,
                        options: DesignOptions = DesignOptions(), seed: int = 0, certain_top_slice: bool = True,
                        scales: list[CalibratedScale | None] | None = None, row: int = 0
                        ) -> tuple[list[Selection], pd.DataFrame]:
    """Every layer's targeted Poisson selection and the choice log (CHOICE_COLUMNS, one row per layer and KV head
    of batch row ``row``). views/scores: per layer, as ``kvcert.generation.select`` reads them (scores
    (batch, kv_heads, n)); the draws follow ``seed`` layer after layer, as ``select`` does."""
    generator = torch.Generator().manual_seed(int(seed))
    choices = _choose_all_layers(views, scores, target, budget, options, certain_top_slice, scales)
    selections, frames = [], []
    for layer, choice in enumerate(choices):
        # drawn layer after layer from one generator, as poisson_design is by ``select``
        keep = poisson_sample(choice.pi.cpu(), generator).to(scores[layer].device)
        selection = _pack(keep, torch.log(choice.pi))
        selections.append(selection)
        heads = choice.expected_count.shape[1]
        frames.append(pd.DataFrame({
            "layer": np.full(heads, layer), "kv_head": np.arange(heads),
            "expected_count": choice.expected_count[row].cpu().numpy(), "cap_count": np.full(heads, choice.cap_count),
            "context_tokens": np.full(heads, choice.n), "retained": selection.retained[row].cpu().numpy(),
            "predicted_rel_cert": choice.predicted[row].cpu().numpy(), "met": choice.met[row].cpu().numpy(),
        }))
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=CHOICE_COLUMNS)
    return selections, frame[CHOICE_COLUMNS]


def _choose_all_layers(views, scores, target, budget, options, certain_top_slice, scales) -> list[TargetChoice]:
    """Every layer's TargetChoice. Layers of one shape are searched together, their (batch, kv_heads) rows
    stacked, so that a bisection step is a few operations for the whole model instead of per layer (the same
    choice: rows never interact)."""
    if not views:
        return []
    same_shape = len({tuple(layer_scores.shape) for layer_scores in scores}) == 1
    # layers on several devices (accelerate's device_map) are searched where each lives, one by one
    same_shape = same_shape and len({layer_scores.device for layer_scores in scores}) == 1
    if not same_shape:
        return [choose_expected_counts(view, layer_scores, target, budget, options, certain_top_slice,
                                       scales[i] if scales is not None else None)
                for i, (view, layer_scores) in enumerate(zip(views, scores))]
    terms = [window_terms(view) for view in views]
    stacked = WindowTerms(torch.cat([t.weights for t in terms]), torch.cat([t.out_norm_sq for t in terms]))
    batch = scores[0].shape[0]
    calibration = None
    if scales is not None and any(scale is not None for scale in scales):
        identity = CalibratedScale(1.0, 1.0, 0.0, True, 0.0)  # a layer without a factor: its paper certificate
        rows = [scale or identity for scale in scales for _ in range(batch)]
        column = lambda name: torch.tensor([float(getattr(r, name)) for r in rows],  # noqa: E731
                                           dtype=torch.float64, device=scores[0].device).view(-1, 1, 1)
        calibration = _RowScales(column("factor"), column("cert_weight"), column("norm_weight"),
                                 column("never_below_paper").bool(), column("floor"))
    attention = (torch.cat([window_attention_mass(view) for view in views])
                 if options.head_attention_share > 0 else None)
    choice = choose_expected_counts(views[0], torch.cat(scores), target, budget, options, certain_top_slice,
                                    calibration, stacked, check=False, attention=attention)
    return [TargetChoice(choice.expected_count[i * batch:(i + 1) * batch], choice.cap_count, choice.n,
                         choice.pi[i * batch:(i + 1) * batch], choice.predicted[i * batch:(i + 1) * batch],
                         choice.met[i * batch:(i + 1) * batch]) for i in range(len(views))]


@dataclass(frozen=True)
class _RowScales:
    """CalibratedScale with one value per stacked row: tensors (rows, 1, 1) broadcast over (rows, kv_heads, w)."""

    factor: torch.Tensor
    cert_weight: torch.Tensor
    norm_weight: torch.Tensor
    never_below_paper: torch.Tensor
    floor: torch.Tensor

    def apply(self, relative: torch.Tensor) -> torch.Tensor:
        calibrated = self.factor * (self.cert_weight * relative + self.norm_weight)
        calibrated = torch.where(self.never_below_paper, torch.maximum(calibrated, relative), calibrated)
        return torch.maximum(calibrated, self.floor)


def check_target(design: str, target_error, target_delta, target_floor=HALF_CAP) -> Target | None:
    """The Target of ``generate``'s / a cell's keys, or None without one; one clear line for a bad one.
    target_floor: HALF_CAP (the default, which a design without a chosen sample and a call without a target
    ignore), None (no floor) or a fraction of the prefix in (0, 1]."""
    explicit_floor = target_floor is not None and target_floor != HALF_CAP
    if target_error is None:
        if target_delta is not None:
            raise ValueError(f"target_delta={target_delta!r} is set but target_error is null: give both or neither")
        if explicit_floor:
            raise ValueError(f"target_floor={target_floor!r} is set but target_error is null: a floor is part of a "
                             "target")
        if design == "clt":
            raise ValueError(CLT_NEEDS_TARGET)
        return None
    if design not in TARGET_DESIGNS:
        raise ValueError(f"target_error={target_error!r} needs design 'poisson' (a Poisson sample of the chosen size) "
                         f"or 'clt' (the decode-time sampler); got design {design!r}")
    if explicit_floor and design != "poisson":
        raise ValueError(f"target_floor={target_floor!r} applies to design 'poisson' (the sample chosen at prefill); "
                         f"design {design!r} keeps the whole cache")
    return Target(error=float(target_error) if isinstance(target_error, (int, float)) else target_error,
                  delta=DELTA if target_delta is None else target_delta, floor=target_floor)


__all__ = ["CHOICE_COLUMNS", "FLOOR_SHARE_OF_CAP", "HALF_CAP", "CalibratedScale", "Target", "TargetChoice", "WindowTerms", "calibrated_scales",
           "check_target", "choose_expected_counts", "predicted_relative_certificate",
           "row_inclusion_probabilities", "target_design", "targeted_selections", "window_terms"]

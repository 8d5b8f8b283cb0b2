"""Budget allocators: how many slots each (layer, KV head) keeps, before a design picks which (docs/METHOD.md §2b).

An allocator turns one budget fraction into one ``LayerBudget`` per layer; the designs (kvcert.designs) then
keep exactly that many slots (top-k) or sample with Σπ equal to it (Poisson), over the allocator's pool:

* ``uniform``: every KV head of every layer keeps ``retained_count(budget, n)`` slots (what kvcert always did).
* ``adakv`` (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation", arXiv
  2407.11550): the KV heads of a layer pool their budget, H · retained_count(budget, n) slots ranked across
  heads by the policy's scores, each head keeping at least a safeguard share ``alpha_safeguard`` of the
  uniform count (its top-scored slots). Any policy's scores can be pooled.
* ``pyramidkv`` (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
  Funneling", arXiv 2406.02069): layer-wise, an arithmetic progression from the first layer (most slots) to
  the last (fewest) with steepness ``beta``; the layers' counts sum to the uniform allocation's total.

The certain slots (the first n_sink and last n_recent positions) stay certain under every allocator and
count against the budget, as they do under ``uniform``: a head always keeps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .sampling import minimum_count, retained_count


@dataclass(frozen=True)
class LayerBudget:
    """What an allocator gives one layer (batch, kv_heads, n).

    count: slots per KV head (on average over the heads when pooled; expected, for the Poisson design);
    pooled: the layer's KV heads share count · kv_heads slots, ranked (or sampled) across heads;
    safeguard: when pooled, each head keeps at least its ``safeguard`` top-ranked slots (and its certain ones).
    """

    count: int
    pooled: bool = False
    safeguard: int = 0


@dataclass(frozen=True)
class Uniform:
    """Every (layer, KV head) keeps the same count."""

    def allocate(self, budget: float, n: int, n_layers: int, n_sink: int, n_recent: int) -> list[LayerBudget]:
        """One LayerBudget per layer for a prefix of n tokens."""
        return [LayerBudget(retained_count(budget, n, n_sink, n_recent))] * n_layers


@dataclass(frozen=True)
class AdaKV:
    """Head-wise within a layer (Feng et al. 2024): the heads pool the layer's budget.

    alpha_safeguard: the share of the uniform count each head keeps of its own top-scored slots, whatever the
    other heads' scores (int(alpha · count), at least 1 when alpha > 0, as in the paper's code and kvpress).
    """

    alpha_safeguard: float = 0.2

    def __post_init__(self):
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"alpha_safeguard={self.alpha_safeguard} must lie in [0, 1]")

    def allocate(self, budget: float, n: int, n_layers: int, n_sink: int, n_recent: int) -> list[LayerBudget]:
        count = retained_count(budget, n, n_sink, n_recent)
        return [LayerBudget(count, pooled=True, safeguard=adakv_safeguard(count, self.alpha_safeguard))] * n_layers


def adakv_safeguard(count: int, alpha_safeguard: float) -> int:
    """Slots a head keeps of its own under AdaKV: int(alpha · count), raised to 1 when alpha > 0 and count > 0."""
    safe = int(count * alpha_safeguard)
    return max(1, safe) if alpha_safeguard > 0 and count > 0 else safe


@dataclass(frozen=True)
class PyramidKV:
    """Layer-wise (Cai et al. 2024): more slots in lower layers, fewer in higher ones, the same total.

    window_size: the slots the pyramid's formula reserves per layer (the paper's observation window); null: the
    certain slots n_sink + n_recent. beta: the steepness (the last layer keeps about count / beta beyond the
    window).
    """

    window_size: int | None = None
    beta: float = 20.0

    def __post_init__(self):
        if self.beta < 1:
            raise ValueError(f"beta={self.beta} must be >= 1")
        if self.window_size is not None and self.window_size < 0:
            raise ValueError(f"window_size={self.window_size} must be >= 0")

    def allocate(self, budget: float, n: int, n_layers: int, n_sink: int, n_recent: int) -> list[LayerBudget]:
        count = retained_count(budget, n, n_sink, n_recent)
        floor = minimum_count(n, n_sink, n_recent)
        window = floor if self.window_size is None else self.window_size
        real = pyramid_budgets(count, n, n_layers, window, self.beta)
        counts = _round_to_total(real, count * n_layers)
        if min(counts) < floor or max(counts) > n:  # a window below the certain slots: the pyramid cannot apply
            counts = [count] * n_layers
        return [LayerBudget(c) for c in counts]


def pyramid_budgets(mean_count: float, n: int, n_layers: int, window_size: float, beta: float) -> list[float]:
    """PyramidKV's per-layer slot counts (real-valued), first layer first, averaging ``mean_count``.

    The formula of the paper's code, as kvpress's PyramidKVPress states it: with c = mean_count, the last
    layer keeps c / beta, the first 2c − c / beta (capped at n − window_size, the last then raised so the
    two still average c), linearly in between. Where the capped pyramid would give a layer fewer than
    window_size or more than n slots, every layer keeps c (the uniform allocation), and so does a single layer
    (kvpress gives it the pyramid's top, 2c − c / beta, which breaks the total).
    """
    if n_layers == 1:
        return [float(mean_count)]
    low = mean_count / beta
    high = 2 * mean_count - low
    if high >= n - window_size:
        high = n - window_size
        low = 2 * mean_count - high
    if not n >= high >= low >= window_size:
        return [float(mean_count)] * n_layers
    step = (high - low) / (n_layers - 1)
    return [high - i * step for i in range(n_layers)]


def _round_to_total(values: list[float], total: int) -> list[int]:
    """Integers within 1 of ``values`` summing to ``total`` (largest remainder; ties to the earlier layer)."""
    floors = [math.floor(v) for v in values]
    short = total - sum(floors)  # 0 <= short < len(values), up to the float sum's rounding
    order = sorted(range(len(values)), key=lambda i: (-(values[i] - floors[i]), i))
    for i in order[: max(0, short)]:
        floors[i] += 1
    for i in order[len(order) - max(0, -short):]:  # a float sum above the total: the smallest remainders give
        floors[i] -= 1
    return floors


ALLOCATORS: dict[str, Callable[..., object]] = {"uniform": Uniform, "adakv": AdaKV, "pyramidkv": PyramidKV}


def get_allocator(name: str, **options):
    """The allocator ``name`` with its keyword options (its dataclass fields)."""
    if name not in ALLOCATORS:
        raise ValueError(f"allocator={name!r} is unknown; known: {sorted(ALLOCATORS)}")
    return ALLOCATORS[name](**options)


__all__ = ["ALLOCATORS", "AdaKV", "LayerBudget", "PyramidKV", "Uniform", "adakv_safeguard", "get_allocator",
           "pyramid_budgets"]

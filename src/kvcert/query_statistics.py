"""The statistics of a layer's prefix queries before RoPE, and the layer's RoPE after the prefix.

ExpectedAttention (``kvcert.policies.expected_attention``) scores keys by the attention that future queries
are expected to pay them, modelling a future query as Gaussian with the mean and covariance of the prefix's
queries before RoPE, rotated by the RoPE of the positions after the prefix. The prefill records what that
needs when it is asked to (``kvcert.prefill(..., query_statistics=True)``), one ``QueryStatistics`` per layer:

* the model's rotary tables (cos, sin) for the prefix and ``FUTURE_POSITIONS`` positions after it, taken
  from the model's own rotary embedding (per layer type where the model has several, as Gemma 3's local
  and global layers do);
* each prefix query un-rotated with its position's table (the attention function sees queries after RoPE):
  the first ``QUERY_HEAD`` one by one, so that a policy can leave out up to that many leading (sink) queries,
  and the sum and the sum of outer products of the rest, in float64.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

QUERY_HEAD = 16  # leading prefix queries kept one by one: a policy may leave out up to this many
FUTURE_POSITIONS = 4096  # positions after the prefix whose rotary tables are kept


def check_statistics_options(n_future_positions, n_sink) -> None:
    """The options of a policy reading these statistics (expected_attention, cap): one ValueError line each."""
    if not isinstance(n_future_positions, int) or not 1 <= n_future_positions <= FUTURE_POSITIONS:
        raise ValueError(f"n_future_positions={n_future_positions!r} must be an integer in "
                         f"1..{FUTURE_POSITIONS} (the positions whose rotary tables the prefill keeps)")
    if not isinstance(n_sink, int) or not 0 <= n_sink <= QUERY_HEAD:
        raise ValueError(f"n_sink={n_sink!r} must be an integer in 0..{QUERY_HEAD} (the leading queries "
                         "the prefill keeps one by one)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., r) -> (..., r): [x1, x2] -> [-x2, x1], the pairing of transformers' RoPE."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrotate(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Queries before RoPE from queries after it: queries (b, h, m, d), cos/sin (m, r) with r ≤ d rotated dims
    (partial rotary leaves dims r.. as they are). Inverts q·cos + rotate_half(q)·sin exactly, also where the
    tables carry an attention scaling (cos² + sin² ≠ 1). Returns (b, h, m, d) float64."""
    q = queries.double()
    r = cos.shape[-1]
    # the queries' device: a layer of a model dispatched over several devices may live apart from the tables
    c, s = cos.to(q.device, torch.float64), sin.to(q.device, torch.float64)
    rotated = q[..., :r]
    plain = (rotated * c - rotate_half(rotated) * s) / (c * c + s * s)
    return torch.cat([plain, q[..., r:]], dim=-1)


def rotary_tables(model, n_positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the model's rotary (cos, sin), each (n_positions, r) float32, for positions 0..n_positions-1.

    The model's rotary embedding module is used as the model itself uses it (with the layer's type where its
    forward takes one); layers of one type share one pair of tensors. Raises ValueError if the model has none.
    """
    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no rotary position embedding: query statistics "
                         "(policy expected_attention) need one")
    config = model.config.get_text_config(decoder=True)
    n_layers = config.num_hidden_layers
    typed = "layer_type" in inspect.signature(rotary.forward).parameters
    layer_types = list(getattr(config, "layer_types", None) or [None] * n_layers) if typed else [None] * n_layers
    # the rotary module's own device (a model dispatched by accelerate's device_map may place it apart)
    device = next(rotary.buffers(), next(model.parameters())).device
    positions = torch.arange(n_positions, device=device).unsqueeze(0)
    probe = torch.zeros((), dtype=torch.float32, device=device)
    tables = {}
    for layer_type in set(layer_types):
        args = (layer_type,) if typed else ()
        cos, sin = rotary(probe, positions, *args)
        tables[layer_type] = (cos[0].float(), sin[0].float())
    return [tables[t] for t in layer_types]


@dataclass
class QueryStatistics:
    """One layer's prefix queries before RoPE, summarised, and its rotary tables after the prefix.

    head: (b, q_heads, min(n, QUERY_HEAD), d) float64 queries of positions 0, 1, ...; tail_sum: (b, q_heads, d)
    and tail_outer: (b, q_heads, d, d) float64 sums of the later queries and of their outer products,
    tail_count of them; future_cos, future_sin: (FUTURE_POSITIONS, r) the rotary tables of positions n, n+1, ...
    (r ≤ d: the rotated dims).
    """

    tables: tuple[torch.Tensor, torch.Tensor] = field(repr=False)  # (n + FUTURE_POSITIONS, r) cos, sin
    head: torch.Tensor | None = None
    tail_sum: torch.Tensor | None = None
    tail_outer: torch.Tensor | None = None
    tail_count: int = 0

    def add(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Record queries after RoPE (b, q_heads, m, d) at prefix positions (m,), in order of position."""
        cos, sin = self.tables
        if cos.device != queries.device:  # kept where the layer lives (accelerate's device_map)
            cos, sin = self.tables = (cos.to(queries.device), sin.to(queries.device))
        plain = unrotate(queries, cos[positions], sin[positions])
        first = positions < QUERY_HEAD
        head = plain[..., first, :]
        self.head = head if self.head is None else torch.cat([self.head, head], dim=-2)
        rest = plain[..., ~first, :]
        if self.tail_sum is None:
            b, h, _, d = plain.shape
            self.tail_sum = plain.new_zeros((b, h, d))
            self.tail_outer = plain.new_zeros((b, h, d, d))
        self.tail_sum += rest.sum(-2)
        self.tail_outer += torch.matmul(rest.transpose(-1, -2), rest)
        self.tail_count += rest.shape[-2]

    def finish(self, n: int) -> QueryStatistics:
        """After the prefill of n positions: keep only the tables after the prefix."""
        cos, sin = self.tables
        self.tables = (cos[n: n + FUTURE_POSITIONS], sin[n: n + FUTURE_POSITIONS])
        return self

    @property
    def future_cos(self) -> torch.Tensor:
        return self.tables[0]

    @property
    def future_sin(self) -> torch.Tensor:
        return self.tables[1]

    def moments(self, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean (b, q_heads, d) and covariance (b, q_heads, d, d), float64, of the queries at positions ≥ skip
        (the covariance normalised by their count, not count − 1)."""
        if not 0 <= skip <= self.head.shape[-2]:
            raise ValueError(f"skip={skip}: the statistics keep the first {self.head.shape[-2]} queries one by one")
        kept = self.head[..., skip:, :]
        count = self.tail_count + kept.shape[-2]
        if count == 0:
            raise ValueError(f"skip={skip} leaves no query of the prefix")
        mean = (self.tail_sum + kept.sum(-2)) / count
        second = (self.tail_outer + torch.matmul(kept.transpose(-1, -2), kept)) / count
        return mean, second - mean.unsqueeze(-1) * mean.unsqueeze(-2)

    def mean_rotation(self, n_future: int, head_dim: int) -> torch.Tensor:
        """(d, d) float64: the RoPE rotation averaged over the next ``n_future`` positions (identity on the
        dims partial rotary leaves alone): mean_t (diag(cos_t) + diag(sin_t)·J), J the rotate_half matrix."""
        if not 1 <= n_future <= self.future_cos.shape[0]:
            raise ValueError(f"n_future_positions={n_future}: must be in 1..{self.future_cos.shape[0]}")
        cos = self.future_cos[:n_future].double().mean(0)
        sin = self.future_sin[:n_future].double().mean(0)
        r = cos.shape[-1]
        half = r // 2
        rotation = torch.eye(head_dim, dtype=torch.float64, device=cos.device)
        rotation[:r, :r] = torch.diag(cos)
        idx = torch.arange(half, device=cos.device)
        rotation[idx, idx + half] = -sin[:half]  # (R q)_i = cos_i q_i − sin_i q_{i+half}
        rotation[idx + half, idx] = sin[half:]  # (R q)_{i+half} = cos q_{i+half} + sin q_i
        return rotation


__all__ = ["FUTURE_POSITIONS", "QUERY_HEAD", "QueryStatistics", "rotary_tables", "unrotate"]

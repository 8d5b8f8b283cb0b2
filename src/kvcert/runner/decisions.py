"""What decided each answer of a cell: one ``decisions.parquet`` row per item × configuration, beside items.parquet.

Two runs of a cell on two CPU models round float32 differently, so an answer that was decided by a hair can be
decided the other way. Each row records how close its answer came to another outcome:

- the decode margin: over the generated steps, the smallest gap between the chosen token's logit and the
  runner-up's (float32, the output layer's scores as the model returns them), with its step, both tokens and the
  chosen token's logit;
- the draw margin (design poisson): over the item's Poisson inclusion decisions, the smallest |u − π| / π of a
  uniform draw u against its inclusion probability π (``kvcert.sampling.draw_margin``); NaN where nothing was
  drawn (the full cache, top-k, and design clt, which draws at decode time);
- a digest of the Poisson draws' outcome (every layer's kept mask), so that two runs can tell whether they
  sampled the same tokens ("" where nothing was drawn).

``near_tie`` says whether a row's margins are within what another CPU's rounding can move (the tolerances below);
``workflow/scripts/compare_results.py`` accepts a changed answer across numeric platforms only at such a row.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from contextlib import contextmanager
from typing import Iterator

import pandas as pd
import torch

from ..generation import Configuration, Prefill, configuration_selections
from ..sampling import recording_draws
from ..table_columns import DECISION_COLUMNS, DECISION_FLOAT32, DECISION_INT32

# Float32 logits of one model computed on two CPU models (another vector width, another kernel build) differ by
# about 1e-4 relative: sums reordered by the SIMD width move each float32 reduction by tens of unit roundoffs
# (2^-24 ≈ 6e-8 each), and thirty layers compound it. This is the one measured input of the tolerances below.
LOGIT_RTOL = 1e-4
# The gap between two logits moves by up to the sum of their two movements, 2 · LOGIT_RTOL · |logit|; the steps
# before the decided one attend to generated keys and values that carry the same rounding, so we allow twice
# that: a decode margin at most DECODE_RTOL times the larger of the two logits' magnitudes is a near-tie.
DECODE_RTOL = 4 * LOGIT_RTOL
# π ∝ score (clipped, scaled by one water-filling constant), and the scores come from float32 attention of the
# prefill, no deeper in the network than the logits: π moves by about LOGIT_RTOL relative, and u is the same
# on every CPU (torch's generator). Twice that, as for the decode margin: |u − π| / π <= DRAW_RTOL is a near-tie.
DRAW_RTOL = 2 * LOGIT_RTOL
# The margin kinds near_tie names.
DECODE, DRAW = "decode margin", "draw margin"


class LogitTops:
    """Record the top three logits of every forward pass of ``model`` while active (a forward hook on its
    output layer; the model is not changed): per pass, values (rows, 3) float32 and token ids (rows, 3), of the
    last position. ``initial``: (rows or 1, vocab) logits that decide the first token without a pass (the
    prefill's last logits when the prompt has no suffix)."""

    def __init__(self, model):
        self.model = model
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    @contextmanager
    def recording(self, initial: torch.Tensor | None = None) -> Iterator[LogitTops]:
        self.steps = [] if initial is None else [_tops(initial)]
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if head is None:  # no output layer to observe: the margins stay NaN
            yield self
            return

        def hook(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            self.steps.append(_tops(logits[:, -1] if logits.ndim == 3 else logits))

        handle = head.register_forward_hook(hook)
        try:
            yield self
        finally:
            handle.remove()

    def decode_margin(self, row: int, token_ids: list[int]) -> dict:
        """The smallest gap over row ``row``'s generated steps between the chosen token's logit and the best
        other token's: {decode_margin, decode_margin_step, decided_token, runner_up_token, decided_logit}
        (NaN / -1 when nothing was recorded)."""
        best = {"decode_margin": math.nan, "decode_margin_step": -1, "decided_token": -1, "runner_up_token": -1,
                "decided_logit": math.nan}
        if len(self.steps) < len(token_ids):
            return best
        for step, chosen in enumerate(token_ids):
            values, ids = self.steps[step]
            r = row if values.shape[0] > 1 else 0
            v, i = values[r].tolist(), ids[r].tolist()
            if chosen in i:
                at = i.index(chosen)
                other = 1 if at == 0 else 0
                gap, logit = v[at] - v[other], v[at]
            else:  # chosen outside the top three (a tie broken after rounding): no gap to speak of
                other, gap, logit = 0, 0.0, v[0]
            if math.isnan(best["decode_margin"]) or gap < best["decode_margin"]:
                best = {"decode_margin": gap, "decode_margin_step": step, "decided_token": int(chosen),
                        "runner_up_token": int(i[other]), "decided_logit": logit}
        return best


def _tops(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, vocab) logits -> (values (rows, 3) float32, ids (rows, 3)) on the CPU."""
    top = torch.topk(logits.detach().float(), min(3, logits.shape[-1]), dim=-1)
    return top.values.cpu(), top.indices.cpu()


def draw_summary(records: list[tuple[float, str]]) -> tuple[float, str]:
    """(draw margin, retained-set digest) of one configuration from its ``kvcert.sampling.recording_draws`` records
    (one per layer): the smallest margin (NaN where nothing was sampled) and a sha256 over the layers' kept masks
    ("" where nothing was drawn: the full cache, top-k, design clt)."""
    if not records:
        return math.nan, ""
    finite = [margin for margin, _ in records if math.isfinite(margin)]
    digest = hashlib.sha256("".join(kept for _, kept in records).encode()).hexdigest()
    return (min(finite) if finite else math.nan), digest


def split_draws(records: list[tuple[float, str]], configurations: list[Configuration], n_layers: int
                ) -> list[tuple[float, str]] | None:
    """The draw records of one ``decode_configurations`` call, split per configuration: every Poisson
    configuration's selection draws once per layer, in the configurations' order, and no other design draws
    through ``poisson_sample``. None where the records do not add up to that (then ``draw_record`` redraws)."""
    drawing = [conf.design == "poisson" and not conf.is_full for conf in configurations]
    if len(records) != sum(drawing) * n_layers:
        return None
    out, at = [], 0
    for draws in drawing:
        out.append(draw_summary(records[at:at + n_layers]) if draws else (math.nan, ""))
        at += n_layers if draws else 0
    return out


def draw_record(state: Prefill, conf: Configuration, **selection_options) -> tuple[float, str]:
    """(draw margin, retained-set digest) of one configuration, its selections made again as
    ``kvcert.generation.configuration_selections`` made them for the decode (same seed, same draws): the slow
    path, where ``split_draws`` cannot attribute the decode's own records."""
    if conf.is_full:
        return math.nan, ""
    with recording_draws() as records, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # whatever the selection warns about was said during the decode
        configuration_selections(state, conf, **selection_options)
    return draw_summary(records)


def decision_frame(rows: list[dict]) -> pd.DataFrame:
    """The rows of one item (or a cell) as decisions.parquet stores them: DECISION_COLUMNS, margins float32
    (draw margin float64: u is drawn in float64), steps and token ids int32."""
    frame = pd.DataFrame(rows, columns=DECISION_COLUMNS)
    return frame.astype({**{c: "float32" for c in DECISION_FLOAT32}, **{c: "int32" for c in DECISION_INT32},
                         "draw_margin": "float64", "correct": bool})


def near_ties(row) -> dict[str, float]:
    """The margins of a decisions row that lie within another CPU's rounding (DECODE_RTOL, DRAW_RTOL), by kind
    (DECODE, DRAW): empty when neither does. ``row``: a mapping with DECISION_COLUMNS."""
    ties = {}
    gap, logit = float(row["decode_margin"]), float(row["decided_logit"])
    if not math.isnan(gap) and gap <= DECODE_RTOL * max(abs(logit), abs(logit - gap)):
        ties[DECODE] = gap
    draw = float(row["draw_margin"])
    if not math.isnan(draw) and draw <= DRAW_RTOL:
        ties[DRAW] = draw
    return ties


__all__ = ["DECODE", "DECODE_RTOL", "DRAW", "DRAW_RTOL", "LOGIT_RTOL", "LogitTops", "decision_frame", "draw_record",
           "draw_summary", "near_ties", "split_draws"]

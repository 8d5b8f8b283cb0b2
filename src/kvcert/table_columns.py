"""The cell tables' columns: the contract between the cell runner, which writes them, and everything
that reads them (claims, calibration, notebooks). Imports nothing from kvcert.

``items.parquet``: one row per item × configuration (``ITEM_COLUMNS``); ``steps.parquet``: one row per
item × configuration × query step × layer × KV head that attended to a compressed cache
(``KEY_COLUMNS`` + ``STEP_COLUMNS``). See docs/GLOSSARY.md for the vocabulary.
"""

from __future__ import annotations

# What identifies one configuration of one item (a "run"), in both tables.
KEY_COLUMNS = ["item_id", "policy", "design", "budget", "seed", "setting"]

ITEM_COLUMNS = [
    "item_id", "task", "policy", "design", "budget", "seed", "setting", "prediction", "score", "correct",
    "logprob_mean", "logprob_min", "logprob_first", "cert_mean", "cert_max", "true_err_mean", "true_err_max",
    "retained_tokens", "context_tokens", "new_tokens", "cache_bytes", "full_bytes", "metric", "model", "data",
]

# Per (step, layer, kv_head) of one run: tr V̂, the certificate √(tr V̂/δ), the oracle's true error
# ‖ô − o‖, both relative to ‖ô‖, whether the certificate covered the error, the fraction of output
# coordinates inside their 95% Wald interval, the effective number of sampled terms behind tr V̂ (Kish's
# (Σc)²/Σc² of c = (1 − π) a²) and ‖ô‖ (docs/METHOD.md §7: what a calibrated certificate is made of).
STEP_COLUMNS = [
    "step", "layer", "kv_head", "trace_var", "cert", "true_err", "rel_cert", "rel_err", "coverage", "wald_coverage",
    "tail_ess", "out_norm",
]

# Stored as float32 in steps.parquet (the statistics are computed in float32).
STEP_FLOAT32 = ["trace_var", "cert", "true_err", "rel_cert", "rel_err", "coverage", "wald_coverage", "tail_ess",
                "out_norm"]
STEP_INT32 = ["step", "layer", "kv_head"]

# Optional columns a calibrated run adds (kvcert.calibration): the calibrated certificate, its coverage
# in oracle mode, and their item-level summaries.
CALIBRATED_STEP_COLUMNS = ["cert_calibrated", "coverage_calibrated"]
CALIBRATED_ITEM_COLUMNS = ["cert_calibrated_mean", "cert_calibrated_max", "coverage_calibrated"]

# Optional columns of a cell run with a non-uniform allocator (kvcert.allocators; a uniform cell's table is
# unchanged): the allocator's name and the bytes of the retained slots alone (cache_bytes pads each KV head's
# row to the layer's longest, and an allocator makes the heads' counts differ).
ALLOCATOR_ITEM_COLUMNS = ["allocator", "kept_bytes"]

# Optional columns that name a row's configuration beyond its key columns, added to item rows and step rows only
# where the cell departs from the default (a default cell's tables are unchanged): the allocator (non-uniform) and
# the certain-head share (design_options.head_fraction other than its default). kvcert.analysis.strata reads a
# table without them as the defaults.
ALLOCATOR_STEP_COLUMNS = ["allocator"]
SHARE_COLUMNS = ["head_fraction"]
# Likewise the certificate's defenses (design_options.tail_mix, head_attention_share; kvcert.sampling), each added
# only where the cell sets it above 0: a row without the column ran without that defense.
DEFENSE_COLUMNS = ["tail_mix", "head_attention_share"]

# ``decisions.parquet`` (kvcert.runner.decisions): one row per item × configuration, what decided its answer: the
# decode margin (smallest gap, over the generated steps, between the chosen token's logit and the runner-up's; its
# step, both tokens and the chosen logit), the draw margin (smallest |u − π| / π over the Poisson draws; NaN where
# nothing was drawn) and a digest of what the draws kept. A separate table, so that items.parquet and steps.parquet
# stay as they were; a row's configuration is named in full (allocator and certain-head share always).
DECISION_COLUMNS = [
    "item_id", "policy", "design", "budget", "seed", "setting", "allocator", "head_fraction", "model", "task",
    "correct", "decode_margin", "decode_margin_step", "decided_token", "runner_up_token", "decided_logit",
    "draw_margin", "draws_sha256",
]
DECISION_FLOAT32 = ["decode_margin", "decided_logit"]
DECISION_INT32 = ["decode_margin_step", "decided_token", "runner_up_token"]

__all__ = [
    "ALLOCATOR_ITEM_COLUMNS", "DECISION_COLUMNS", "DECISION_FLOAT32", "DECISION_INT32", "ALLOCATOR_STEP_COLUMNS", "DEFENSE_COLUMNS", "SHARE_COLUMNS", "CALIBRATED_ITEM_COLUMNS", "CALIBRATED_STEP_COLUMNS", "ITEM_COLUMNS", "KEY_COLUMNS", "STEP_COLUMNS",
    "STEP_FLOAT32", "STEP_INT32",
]

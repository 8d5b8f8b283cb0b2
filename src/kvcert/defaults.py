"""The method's default knobs, written once. The library's signatures and the Hydra configs
(``conf/run.yaml`` reads them through the ``${kvcert_default:NAME}`` resolver) both take them from here.
Imports nothing; see docs/GLOSSARY.md for what each knob means."""

N_SINK = 4  # attention sinks: the first tokens, always kept (π = 1)
N_RECENT = 32  # recent window: the last prefix tokens, always kept (π = 1)
HEAD_FRACTION = 0.5  # share of the budget beyond sinks + recent window kept with certainty by score
PI_MIN = 1e-3  # floor of a sampled token's inclusion probability
OBSERVATION_WINDOW = 16  # last prompt tokens whose queries score the cache (SnapKV, TOVA)
DELTA = 0.05  # certificate level: √(tr V̂/δ) bounds the error with probability ≥ 1 − δ (Chebyshev)

BY_NAME = {
    "n_sink": N_SINK,
    "n_recent": N_RECENT,
    "head_fraction": HEAD_FRACTION,
    "pi_min": PI_MIN,
    "observation_window": OBSERVATION_WINDOW,
    "delta": DELTA,
}

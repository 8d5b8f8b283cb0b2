"""Decode-step cost of the certificate on SmolLM2-135M-Instruct.

Configurations, all on one shared prefill per context (question-aware pass-key prompt):
  (a) full cache; (b) compressed, deterministic ``topk``; (c) compressed ``poisson`` with the Hájek offset
  (certify=False, oracle=False); (d) = (c) + certificate (certify=True); (e) = (d) + oracle (true error);
  (f) = (d) + the calibrated certificate (``kvcert.calibration``: a per-layer conformal file, loaded and
  checked against the model once, as ``kvcert-run calibration=<file>`` does; its factors applied to every
  step row).
They are timed side by side, one forward pass at a time: a round starts one ``kvcert.Decoding`` per
configuration and advances them in turn, pass by pass (the order reversed on every other pass), so the
configurations' passes run tens of milliseconds apart and the drift of a shared machine hits them alike.
A configuration's time in a round is its whole decode: set-up (deriving the cache), every pass and the
results (step records). Certifying attention runs the compiled kernel where it applies (``kvcert.kernels``;
``KVCERT_KERNELS=0`` measures the PyTorch path instead). The table reports the median
milliseconds per decode step (that time / forward passes), the ratios d/c and e/c as the median of the
per-round ratios with their interquartile range, after a warm-up round, and the bytes of the compressed
prefix cache over the full one.

    python benchmarks/certificate_overhead.py [--contexts 1000 4000] [--budget 0.25] [--reps 9]
        [--calibration results/calibration/smollm2.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvcert
from kvcert.calibration import apply_calibration, prepare_calibration
from kvcert.theory import passkey_prompt

OPTIONS = {  # decode options per configuration, in table order
    "a_full": dict(certify=False, oracle=False),
    "b_topk": dict(certify=False, oracle=False),
    "c_poisson": dict(certify=False, oracle=False),
    "d_poisson_cert": dict(certify=True, oracle=False),
    "e_poisson_cert_oracle": dict(certify=True, oracle=True),
    "f_poisson_cert_calibrated": dict(certify=True, oracle=False),
}
CONFIGS = tuple(OPTIONS)
CALIBRATED = "f_poisson_cert_calibrated"


def prompt_ids(tokenizer, target_tokens: int, seed: int = 0) -> torch.Tensor:
    """(1, n) ids of a pass-key prompt (context + question) with about ``target_tokens`` tokens."""
    per_paragraph = len(tokenizer(passkey_prompt(n_noise=20, seed=seed)[0]).input_ids) / 24.0
    n_noise = max(4, round(target_tokens / per_paragraph) - 4)
    context, question, _ = passkey_prompt(n_noise=n_noise, n_needles=4, seed=seed)
    return tokenizer(context + question, return_tensors="pt").input_ids


def interleaved_round(model, state, selections, new_tokens: int, reverse: bool, calibrate=None) -> dict:
    """One decode per configuration, their forward passes interleaved; ``calibrate`` (Decoded -> Decoded)
    adds the calibrated certificate to (f)'s results, timed with them.

    Returns {name: (seconds of the whole decode, seconds of its forward passes alone, passes, Decoded)}.
    """
    order = list(reversed(CONFIGS)) if reverse else list(CONFIGS)
    seconds = dict.fromkeys(CONFIGS, 0.0)
    pass_seconds = dict.fromkeys(CONFIGS, 0.0)
    decodings = {}
    for name in order:
        start = time.perf_counter()
        decodings[name] = kvcert.Decoding(model, state, [selections[name]], max_new_tokens=new_tokens,
                                          stop_ids=set(), **OPTIONS[name])
        seconds[name] += time.perf_counter() - start
    passes = dict.fromkeys(CONFIGS, 0)
    running = list(order)
    while running:
        still = []
        for name in running:
            start = time.perf_counter()
            more = decodings[name].advance()
            elapsed = time.perf_counter() - start
            seconds[name] += elapsed
            pass_seconds[name] += elapsed if more else 0.0  # the last call only picks a token
            passes[name] += more
            if more:
                still.append(name)
        running = still[::-1]  # alternate the order from pass to pass
    results = {}
    for name in order:
        start = time.perf_counter()
        results[name] = decodings[name].results()[0]
        if name == CALIBRATED and calibrate is not None:
            results[name] = calibrate(results[name])
        seconds[name] += time.perf_counter() - start
    return {name: (seconds[name], pass_seconds[name], passes[name], results[name]) for name in CONFIGS}


def benchmark(model, tokenizer, context_tokens: int, budget: float, reps: int, new_tokens: int,
              calibration) -> dict:
    ids = prompt_ids(tokenizer, context_tokens)
    state = kvcert.prefill(model, ids)
    # checked once, as the cell runner does; applied per decode
    checked = prepare_calibration(calibration, model=model, setting="question_aware",
                                  configurations=[("snapkv", "poisson", budget)])

    def calibrate(decoded):
        decoded.steps = apply_calibration(checked, decoded.steps, design="poisson", policy="snapkv", budget=budget,
                                          setting="question_aware", checked=True)
        return decoded

    selections = {
        "a_full": None,
        "b_topk": kvcert.select(state, "snapkv", "topk", budget, seed=0),
        "c_poisson": kvcert.select(state, "snapkv", "poisson", budget, seed=0),
    }
    for name in ("d_poisson_cert", "e_poisson_cert_oracle", CALIBRATED):
        selections[name] = selections["c_poisson"]
    times = {name: [] for name in CONFIGS}
    pass_times = {name: [] for name in CONFIGS}
    for rep in range(reps + 1):  # round 0 is the warm-up
        measured = interleaved_round(model, state, selections, new_tokens, reverse=rep % 2 == 1, calibrate=calibrate)
        if rep > 0:
            for name, (seconds, in_passes, passes, _) in measured.items():
                times[name].append(seconds / max(1, passes))
                pass_times[name].append(in_passes / max(1, passes))
    decoded = {name: result for name, (_, _, _, result) in measured.items()}
    # Same retained sets and offsets: the certificate and oracle must not change the generated tokens.
    assert all(decoded["c_poisson"].token_ids == decoded[n].token_ids for n in CONFIGS[3:])
    assert decoded[CALIBRATED].steps["cert_calibrated"].notna().all()
    med = {name: 1e3 * statistics.median(t) for name, t in times.items()}

    def paired(name: str, times: dict = times) -> tuple[float, float, float]:
        """Median and quartiles of the per-round ratio name / c."""
        return median_quartiles([x / c for x, c in zip(times[name], times["c_poisson"])])

    return {
        "context_tokens": state.context_tokens,
        "ms_per_step": med,
        "d_over_c": paired("d_poisson_cert"),
        "d_over_c_passes": paired("d_poisson_cert", pass_times),
        "e_over_c": paired("e_poisson_cert_oracle"),
        "f_over_c": paired(CALIBRATED),
        "bytes_ratio_topk": decoded["b_topk"].cache_bytes / decoded["b_topk"].full_bytes,
        "bytes_ratio_poisson": decoded["c_poisson"].cache_bytes / decoded["c_poisson"].full_bytes,
    }


def median_quartiles(ratios: list[float]) -> tuple[float, float, float]:
    """Median, first and third quartile of per-round ratios (the one ratio thrice for a single round)."""
    ratios = sorted(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), q1, q3


def timing_parser(doc: str) -> argparse.ArgumentParser:
    """The options every side-by-side decode-time benchmark here takes: contexts, budget, rounds, tokens, threads."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = timing_parser(__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--calibration", default="results/calibration/smollm2.json",
                        help="calibration file of the model (kvcert-calibrate), or 'design'")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, tokenizer = kvcert.load_model(args.model)
    rows = [benchmark(model, tokenizer, n, args.budget, args.reps, args.new_tokens, args.calibration)
            for n in args.contexts]

    print(f"\nbudget {args.budget}, {args.new_tokens} new tokens, median of {args.reps} rounds of interleaved passes, "
          f"{args.threads} threads; ratios: median [interquartile range] of the per-round ratios")
    header = ["context", *[c.split("_", 1)[0] + " ms/step" for c in CONFIGS], "d/c", "d/c passes only", "e/c", "f/c",
              "bytes topk", "bytes poisson"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        ratio = lambda m, q1, q3: f"{m:.3f} [{q1:.3f}, {q3:.3f}]"  # noqa: E731
        cells = [str(r["context_tokens"]), *[f"{r['ms_per_step'][c]:.1f}" for c in CONFIGS],
                 ratio(*r["d_over_c"]), ratio(*r["d_over_c_passes"]), ratio(*r["e_over_c"]), ratio(*r["f_over_c"]),
                 f"{r['bytes_ratio_topk']:.3f}",
                 f"{r['bytes_ratio_poisson']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    print("(a) full cache, (b) topk, (c) poisson + offset, (d) (c) + certificate, (e) (d) + oracle, (f) (d) + "
          f"calibrated certificate ({args.calibration}); d/c passes only: the forward passes without set-up and results; "
          f"targets: d/c <= 1.10 and f/c <= 1.10, bytes <= budget + 0.03 = {args.budget + 0.03:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

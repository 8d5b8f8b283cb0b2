"""Exploratory, not pre-registered: the certificate's two defenses on SmolLM2, tried as a new user would.

The defensive tail (``design_options.tail_mix``, λ) mixes a scorer's tail inclusion probabilities with a uniform
share; the attention-aware certain head (``design_options.head_attention_share``, η) gives a share of the certain
head's top slice to the tokens the observation window attends to most (kvcert.sampling). This probe asks how the
certificate's coverage of the true attention-output error, and its width, move with λ and η for two rankings:
CUR (far from attention) and SnapKV (the window's attention itself), Poisson at budget BUDGET.

Prompts: ITEMS RULER-style pass-key prompts of ``kvcert.theory.passkey_prompt`` with seeds from SEED (no study
uses them: the studies read RULER's generated data), question-aware, built as ``kvcert.generate`` builds them;
one prefill per prompt, then every (λ, η) decoded with the oracle on (``kvcert.generation.decode_configurations``,
the decode path of ``generate`` and the cell runner), NEW_TOKENS greedy tokens, the draws seeded per item as the
runner seeds them.

Per (policy, λ, η), pooled over the prompts' (step, layer, KV head) rows: coverage (share with true error ≤
certificate), the median relative certificate (certificate / ‖ô‖), the median relative true error, the median
certificate / true error, and accuracy (answers containing the pass key). Written atomically to OUT.

    python benchmarks/defense_probe.py            # make defense-probe

Sizes were fixed before any number was read: 8 prompts, 24 noise paragraphs and 4 keys each, 8 new tokens, seed 0
of the draws, one thread per process on the shared 2 cores. The probe is about the certificate: with 4 keys the
135M model rarely names the asked one (its full cache answered the first prompt with another key), so accuracy
here says little about the defenses' cost; the studies measure that.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np
import pandas as pd

SEED = 9100  # the prompts' seeds: SEED, SEED + 1, ...
ITEMS = 8
NOISE, NEEDLES = 24, 4
NEW_TOKENS = 8
BUDGET = 0.25
POLICIES = ("cur", "snapkv")
TAIL_MIX = (0.0, 0.2, 0.5, 1.0)
HEAD_ATTENTION_SHARE = (0.0, 0.5, 1.0)
OUT = Path("results/exploratory/defenses/coverage.csv")
COLUMNS = ["policy", "design", "budget", "tail_mix", "head_attention_share", "items", "rows", "coverage",
           "median_rel_cert", "median_rel_err", "median_cert_over_err", "accuracy"]


def probe(threads: int = 1) -> pd.DataFrame:
    import torch
    from tqdm import tqdm

    import kvcert
    from kvcert.generation import Configuration, decode_configurations, eos_ids, prefill
    from kvcert.policies import prefill_needs
    from kvcert.prompts import build_prompt, model_limit
    from kvcert.theory import passkey_prompt

    torch.set_num_threads(threads)
    model, tokenizer = kvcert.load_model("smollm2")
    stop = eos_ids(model, tokenizer)
    grid = list(itertools.product(TAIL_MIX, HEAD_ATTENTION_SHARE))
    steps: dict[tuple, list[pd.DataFrame]] = {}
    correct: dict[tuple, list[bool]] = {}
    with tqdm(total=ITEMS * len(grid), desc="defense probe (prompt x (lambda, eta))") as bar:
        for item in range(ITEMS):
            context, question, answer = passkey_prompt(n_noise=NOISE, n_needles=NEEDLES, seed=SEED + item)
            prompt = build_prompt(tokenizer, context, question, setting="question_aware", max_new_tokens=NEW_TOKENS,
                                  limit=model_limit(model, None))
            state = prefill(model, prompt.prefix_ids, prompt.suffix_ids, setting="question_aware",
                            **prefill_needs(POLICIES))
            configurations = [Configuration(policy, "poisson", BUDGET, 0) for policy in POLICIES]
            for lam, eta in grid:
                options = kvcert.DesignOptions(tail_mix=lam, head_attention_share=eta)
                decoded = decode_configurations(model, state, configurations, item_id=f"defense-probe/{item}",
                                                max_new_tokens=NEW_TOKENS, stop_ids=stop, oracle=True,
                                                options=options)
                for conf, out in zip(configurations, decoded):
                    key = (conf.policy, lam, eta)
                    steps.setdefault(key, []).append(out.steps)
                    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
                    correct.setdefault(key, []).append(answer in text)
                bar.update(1)
    rows = []
    for (policy, lam, eta), frames in steps.items():
        table = pd.concat(frames, ignore_index=True)
        table = table[np.isfinite(table["cert"]) & np.isfinite(table["true_err"])]
        ratio = table["cert"] / table["true_err"].where(table["true_err"] > 0)
        rows.append({"policy": policy, "design": "poisson", "budget": BUDGET, "tail_mix": lam,
                     "head_attention_share": eta, "items": len(frames), "rows": len(table),
                     "coverage": float(table["coverage"].mean()), "median_rel_cert": float(table["rel_cert"].median()),
                     "median_rel_err": float(table["rel_err"].median()),
                     "median_cert_over_err": float(ratio.median()),
                     "accuracy": float(np.mean(correct[(policy, lam, eta)]))})
    return pd.DataFrame(rows, columns=COLUMNS)


def table_cli(run, out: Path, description: str, name: str, argv: list[str] | None = None) -> int:
    """A probe's command line: ``--out`` (default ``out``) and ``--threads``; ``run(threads)`` gives the table, which is
    written atomically and printed (defense_unseen.py shares it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=out, help="the CSV to write (atomically)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    from kvcert.atomic import write_text_atomic

    table = run(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(table.round(4).to_csv(index=False), args.out)
    print(table.round(3).to_string(index=False))
    print(f"{name}: wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return table_cli(probe, OUT, __doc__.split("\n\n")[0], "defense_probe", argv)


if __name__ == "__main__":
    raise SystemExit(main())

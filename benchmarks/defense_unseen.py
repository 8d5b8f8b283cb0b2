"""Exploratory, not pre-registered, written after study v6's results were read: amendment 6's defenses at its
pilot's choice, tried as a new user would, on rankings and workloads that no study uses.

A user who read docs/library.md registers a ranking of their own (``kvcert.register_policy``) and calls
``kvcert.generate`` with ``design_options`` as the docs show; this script does exactly that, and asks whether the
certificate covers the true attention-output error (``oracle=True``) with and without both defenses.

Rankings (registered here, as a user would): ``anti_attention``, the observation window's attention reversed (the
tokens the window attends to most are ranked last: the adversary an attention-aware certain head is meant to survive),
and ``value_norm``, the L2 norm of each value vector (a content ranking no kvpress press uses). SnapKV, the studies'
reference ranking, beside them. Workloads: RULER's variable tracking (``vt``) and multi-value retrieval
(``niah_multivalue``), the built-in generator at CONTEXT_TOKENS tokens with data seed SEED (the studies use
multi-key retrieval, other seeds). Model: the bundled SmolLM2. Design: Poisson at budget BUDGET, the certain-head
share and the defenses read from amendment 6's locked files (the pilot's share; ``chosen`` of population.yaml), one
Poisson draw (seed 0) per item.

Per (workload, ranking, defenses): coverage (share of (step, layer, KV head) rows whose true error is within the
certificate), the median certificate / true error, and accuracy (the item's metric), and the full cache's accuracy
per workload (its certificate columns empty). Written atomically to OUT.

    python benchmarks/defense_unseen.py          # make defense-unseen

Sizes were fixed before any number was read: ITEMS items per workload, NEW_TOKENS new tokens at most (the item's own
limit if smaller), one thread on the shared cores.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
AMENDMENT = ROOT / "preregistration" / "amendment-6"
SEED = 9700
ITEMS = 6
CONTEXT_TOKENS = 1000
NEW_TOKENS = 16
BUDGET = 0.25
WORKLOADS = ("vt", "niah_multivalue")
POLICIES = ("anti_attention", "value_norm", "snapkv")
OUT = ROOT / "results" / "exploratory" / "defenses" / "unseen.csv"
COLUMNS = ["task", "policy", "head_fraction", "tail_mix", "head_attention_share", "items", "rows", "coverage",
           "median_cert_over_err", "accuracy"]


def register_rankings():
    """The two rankings a user adds: each a class with ``score(view) -> (batch, kv_heads, n)``, larger kept first."""
    import kvcert
    from kvcert.policies import POLICIES as KNOWN

    if "anti_attention" in KNOWN:
        return

    @kvcert.register_policy("anti_attention")
    class AntiAttention:
        """The window's attention reversed: the tokens it attends to most get the smallest scores."""

        needs_accumulated_attention = False

        def score(self, view, generator=None):
            attention = view.group_mean(view.window_attention().sum(dim=2))  # (batch, kv_heads, n)
            return 1.0 / (attention + 1e-6)

    @kvcert.register_policy("value_norm")
    class ValueNorm:
        """The L2 norm of each value vector."""

        needs_accumulated_attention = False

        def score(self, view, generator=None):
            return view.values.float().norm(dim=-1)


def defenses() -> tuple[float, dict[str, float]]:
    """(the pilot's certain-head share, the chosen defenses) from amendment 6's locked files."""
    amendment = yaml.safe_load((AMENDMENT / "amendment.yaml").read_text())
    chosen = yaml.safe_load((AMENDMENT / "population.yaml").read_text())["chosen"]
    return float(amendment["pilot"]["share"]), {k: float(chosen[k]) for k in ("tail_mix", "head_attention_share")}


def run(threads: int = 1) -> pd.DataFrame:
    import torch
    from tqdm import tqdm

    import kvcert
    from kvcert.data import load_items, score_item
    from kvcert.data.metrics import is_correct

    torch.set_num_threads(threads)
    register_rankings()
    share, chosen = defenses()
    settings = {"none": {"tail_mix": 0.0, "head_attention_share": 0.0}, "both": chosen}
    model, tokenizer = kvcert.load_model("smollm2")
    rows = []
    work = list(itertools.product(WORKLOADS, POLICIES, settings))
    items = {task: load_items("ruler", {"tasks": [task], "context_tokens": CONTEXT_TOKENS, "seed": SEED},
                              tokenizer, ITEMS) for task in WORKLOADS}
    def ask(item, **configuration):
        """One item through kvcert.generate: (its steps, whether the answer is right)."""
        out = kvcert.generate(model, tokenizer, context=item.context, question=item.question,
                              answer_prefix=item.answer_prefix, item_id=item.id,
                              max_new_tokens=min(NEW_TOKENS, item.max_new_tokens), **configuration)
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return out.steps, is_correct(score_item(item, text), item.metric)

    with tqdm(total=(len(work) + len(WORKLOADS)) * ITEMS, desc="defenses on unseen rankings and workloads") as bar:
        for task in WORKLOADS:  # the full cache's accuracy: what the compressed answers are measured against
            correct = []
            for item in items[task]:
                correct.append(ask(item, policy="full", design="full", budget=1.0)[1])
                bar.update(1)
            rows.append({"task": task, "policy": "full", "items": len(items[task]), "rows": 0,
                         "accuracy": float(np.mean(correct))})
        for task, policy, setting in work:
            options = kvcert.DesignOptions(head_fraction=share, **settings[setting])
            steps, correct = [], []
            for item in items[task]:
                item_steps, right = ask(item, policy=policy, design="poisson", budget=BUDGET, seed=0, oracle=True,
                                        options=options)
                steps.append(item_steps)
                correct.append(right)
                bar.update(1)
            table = pd.concat(steps, ignore_index=True)
            table = table[np.isfinite(table["cert"]) & np.isfinite(table["true_err"])]
            ratio = table["cert"] / table["true_err"].where(table["true_err"] > 0)
            rows.append({"task": task, "policy": policy, "head_fraction": share, **settings[setting],
                         "items": len(items[task]), "rows": len(table), "coverage": float(table["coverage"].mean()),
                         "median_cert_over_err": float(ratio.median()), "accuracy": float(np.mean(correct))})
    return pd.DataFrame(rows, columns=COLUMNS)


def main(argv: list[str] | None = None) -> int:
    from defense_probe import table_cli  # the sibling probe's command line (the script's folder is on sys.path)

    return table_cli(run, OUT, __doc__.split("\n\n")[0], "defense_unseen", argv)


if __name__ == "__main__":
    raise SystemExit(main())

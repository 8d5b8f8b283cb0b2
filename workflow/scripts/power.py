"""The power analysis of a pre-registration amendment, from version 1's bootstrap intervals.

    python workflow/scripts/power.py --v1-claims results/v1/claims --n-qa 700 --n-streaming 600

For each tested component of version 1 (and the C4-C7 secondary intervals), the per-item standard deviation
implied by its 95% percentile interval, sd = width * sqrt(n) / (2 * 1.96), the number of items that makes
the interval span at most ``--span`` (the C1/C2 target, 4 points), and the width expected at the planned
item counts (question-aware items for C1-C5, streaming items for C6-C7). Prints YAML for the amendment.
Uses version 1's variances only, never its verdicts.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import yaml

Z = 1.959964
SETTING = {"c1": "question_aware", "c2": "question_aware", "c3": "question_aware", "c4": "question_aware",
           "c5": "question_aware", "c6": "streaming", "c7": "streaming"}
SECONDARY = {"c4": ["auc_certificate", "auc_confidence"], "c5": ["gain_over_random"],
             "c6": ["auc_certificate", "auc_confidence"], "c7": ["gain_over_random", "gain_over_confidence"]}


def sd_of(low: float, high: float, n: int) -> float:
    return (high - low) * math.sqrt(n) / (2 * Z)


def analysis(claims_dir: Path, span: float, n_qa: int, n_streaming: int) -> dict:
    out = {"formula": "sd = width * sqrt(n) / (2 * 1.96); n_for_span = (2 * 1.96 * sd / span)^2; "
                      "expected width at n = 2 * 1.96 * sd / sqrt(n)",
           "span_target_points": span, "planned_items": {"question_aware": n_qa, "streaming": n_streaming},
           "components": {}}
    for claim in ("c1", "c2", "c4", "c5", "c6", "c7"):
        result = json.loads((claims_dir / f"{claim}.json").read_text())
        n = int(result["n"])
        planned = n_qa if SETTING[claim] == "question_aware" else n_streaming
        entries = [(c["name"], c["ci_low"], c["ci_high"]) for c in result["details"]["components"]]
        entries += [(name, result["details"][name]["ci_low"], result["details"][name]["ci_high"])
                    for name in SECONDARY.get(claim, []) if name in result["details"]
                    and name not in [e[0] for e in entries]]
        for name, low, high in entries:
            sd = sd_of(low, high, n)
            row = {"version_1_interval": [round(low, 4), round(high, 4)], "version_1_items": n, "sd_per_item": round(sd, 4),
                   "expected_width_at_plan": round(2 * Z * sd / math.sqrt(planned), 4)}
            if claim in ("c1", "c2"):
                row["items_for_span"] = math.ceil((2 * Z * sd / span) ** 2)
            out["components"][f"{claim}.{name}"] = row
    binding = [v["items_for_span"] for v in out["components"].values() if "items_for_span" in v]
    out["items_for_span_c1_c2"] = max(binding)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--v1-claims", type=Path, required=True)
    parser.add_argument("--span", type=float, default=4.0)
    parser.add_argument("--n-qa", type=int, required=True)
    parser.add_argument("--n-streaming", type=int, required=True)
    args = parser.parse_args(argv)
    print(yaml.safe_dump(analysis(args.v1_claims, args.span, args.n_qa, args.n_streaming), sort_keys=False, width=110))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

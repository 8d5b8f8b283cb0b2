"""Collect claim results (``<outdir>/<study>/claims/*.json``) into the paper tables.

Writes, into ``--out-dir``:
- ``claims.csv`` / ``claims.md`` / ``claims.tex``: one row per study and claim (the pre-registration
  version the verdict comes from, estimate, 95% CI, threshold, verdict, the paper's verdict, agreement);
- ``reproduction.csv``: the paper's headline numbers beside ours, per study (``REPRODUCTION``);
- ``accuracy.csv``: the studies' accuracy tables (``--accuracy``), one after the other;
- ``claims_by_model.csv``: each claim on each model's cells alone, per study, when a study's cells hold
  several models (``details.by_model`` of the claim results; only the header otherwise).
- ``claims_by_policy.csv``: every component of a claim decided per configuration (amendment 5's C2 and C3,
  kvcert.analysis.strata), one row per (study, claim, model, scorer, allocator, certain-head share, budget,
  component) with the verdict of its scorer by claims.yaml's rule; ``model`` is ``pooled`` for the claim over
  every model, else the model's cells alone (only the header when no study decides a claim so).
A study is named by the folder above a result's ``claims/`` folder. All files are written to a temporary
name and renamed, so a failed run leaves none half-written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvcert.analysis.errors import AnalysisError
from kvcert.atomic import write_text_atomic

CLAIM_COLUMNS = ["study", "prereg", "claim", "title", "component", "estimate", "ci_low", "ci_high", "threshold",
                 "verdict", "paper_verdict", "agrees", "n"]
REPRO_COLUMNS = ["study", "quantity", "paper", "ours", "ci_low", "ci_high", "note"]
BY_POLICY_COLUMNS = ["study", "claim", "model", "policy", "allocator", "head_fraction", "budget", "component",
                     "estimate", "ci_low", "ci_high", "threshold", "verdict", "policy_verdict",
                     "cert_over_true_err_median"]
POOLED = "pooled"
BY_MODEL_COLUMNS = ["study", "claim", "model", "component", "estimate", "ci_low", "ci_high", "threshold", "verdict",
                    "agrees", "n", "error"]


@dataclass(frozen=True)
class Target:
    """A headline number of the paper and where our value sits in a claim's JSON."""

    quantity: str
    paper: str
    claim: str
    path: tuple[str, ...]  # keys into the claim JSON; the leaf holds estimate / ci_low / ci_high
    note: str


REPRODUCTION = (
    Target("certificate coverage", "0.969-0.977", "c3", ("details", "coverage"),
           "fraction of (step, layer, head) with true error <= sqrt(trV/0.05)"),
    Target("Spearman(certificate, true error)", "0.943-0.979", "c3", ("details", "spearman"), ""),
    Target("median relative error at 25%: Poisson+Hajek", "0.0317", "c3",
           ("details", "median_rel_err", "poisson"), "steps.rel_err, question-aware"),
    Target("median relative error at 25%: top-k", "0.0447", "c3", ("details", "median_rel_err", "topk"),
           "steps.rel_err, question-aware"),
    Target("median relative error at 25%: uniform sampling", "0.2386", "c3",
           ("details", "median_rel_err", "uniform"), "steps.rel_err, question-aware"),
    Target("accuracy Poisson minus top-k (points)", "|difference| <= 0.7", "c2", (),
           "binding budget of the non-inferiority test"),
    Target("failure-prediction AUC: certificate", "mean 0.836 (>0.5 in 16/16 cells)", "c4",
           ("details", "auc_certificate"), "the paper found log-probability better"),
    Target("failure-prediction AUC: confidence", "above the certificate's", "c4",
           ("details", "auc_confidence"), ""),
    Target("attribution AUC: certificate", "0.73-0.75 (v2: 0.65-0.75)", "c6",
           ("details", "auc_certificate"), "cache-induced vs inherent failures"),
    Target("attribution AUC: confidence", "0.47-0.54", "c6", ("details", "auc_confidence"), ""),
    Target("escalation gain over random gating (points)", "about 0 (adds nothing)", "c5",
           ("details", "gain_over_random"), "25% escalation rate"),
    Target("recompute gain over random gating (points)", "+1.9 to +3.7", "c7",
           ("details", "gain_over_random"), "streaming, 25% recompute budget"),
    Target("recompute gain over confidence gating (points)", "+1.9 to +3.7", "c7",
           ("details", "gain_over_confidence"), "streaming, 25% recompute budget"),
)


def study_of(path: Path) -> str:
    """The study a claim result belongs to: the folder above its ``claims/`` folder."""
    return path.parent.parent.name if path.parent.name == "claims" else path.parent.name


def load_results(paths: list[Path]) -> dict[str, dict[str, dict]]:
    """{study: {claim: result}}."""
    out: dict[str, dict[str, dict]] = {}
    for p in paths:
        if not p.is_file():
            raise AnalysisError(f"{p}: missing claim result")
        try:
            res = json.loads(p.read_text())
            out.setdefault(study_of(p), {})[str(res["claim"])] = res
        except (ValueError, KeyError, TypeError) as exc:
            raise AnalysisError(f"{p}: not a claim result ({type(exc).__name__}: {exc})") from None
    return out


def _num(x) -> float:
    return math.nan if x is None else float(x)


def _agrees(x) -> str:
    return "n/a" if x is None else ("yes" if x else "no")


def claims_table(studies: dict[str, dict[str, dict]]) -> pd.DataFrame:
    rows = []
    for study in sorted(studies):
        for cid in sorted(studies[study]):
            r = studies[study][cid]
            rows.append({**{c: r.get(c) for c in CLAIM_COLUMNS}, "agrees": _agrees(r.get("agrees")),
                         "study": study, "prereg": int(r.get("details", {}).get("prereg_version", 1)),
                         **{c: _num(r.get(c)) for c in ("estimate", "ci_low", "ci_high", "threshold")}})
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


def by_model_table(studies: dict[str, dict[str, dict]]) -> pd.DataFrame:
    rows = []
    for study in sorted(studies):
        results = studies[study]
        for cid in sorted(results):
            for model, r in sorted((results[cid].get("details", {}).get("by_model") or {}).items()):
                rows.append({"study": study, "claim": cid, "model": model,
                             **{c: r.get(c) for c in ("component", "verdict", "n", "error")},
                             "agrees": _agrees(r.get("agrees")) if "error" not in r else None,
                             **{c: _num(r.get(c)) for c in ("estimate", "ci_low", "ci_high", "threshold")}})
    return pd.DataFrame(rows, columns=BY_MODEL_COLUMNS)


def by_policy_table(studies: dict[str, dict[str, dict]]) -> pd.DataFrame:
    rows = []
    for study in sorted(studies):
        for cid in sorted(studies[study]):
            details = studies[study][cid].get("details", {})
            if details.get("scope") != "per_configuration":
                continue
            for model, part in [(POOLED, details), *sorted((details.get("by_model") or {}).items())]:
                if "components" not in part:  # a model whose cells could not carry the claim alone
                    continue
                by_policy = (part.get("verdict_by") or {}).get("policy", {})
                ratio = part.get("cert_over_true_err_median") or {}
                for comp in part["components"]:
                    key = part["configurations"][comp["name"]]
                    label = f"{key['policy']},{key['allocator']},{key['head_fraction']}"
                    rows.append({"study": study, "claim": cid, "model": model, "policy": key["policy"],
                                 "allocator": key["allocator"], "head_fraction": key["head_fraction"],
                                 "budget": key.get("budget", ""), "component": comp["name"].split("[")[0],
                                 **{c: _num(comp.get(c)) for c in ("estimate", "ci_low", "ci_high", "threshold")},
                                 "verdict": comp.get("verdict"), "policy_verdict": by_policy.get(key["policy"]),
                                 "cert_over_true_err_median": _num(ratio.get(label)) if ratio else None})
    return pd.DataFrame(rows, columns=BY_POLICY_COLUMNS)


def reproduction_table(studies: dict[str, dict[str, dict]]) -> pd.DataFrame:
    return pd.DataFrame([row for study in sorted(studies) for row in _reproduction_rows(study, studies[study])],
                        columns=REPRO_COLUMNS)


def _reproduction_rows(study: str, results: dict[str, dict]) -> list[dict]:
    rows = []
    for t in REPRODUCTION:
        leaf = results.get(t.claim)
        note = t.note
        for key in t.path:
            leaf = leaf.get(key) if isinstance(leaf, dict) else None
        if not isinstance(leaf, dict):
            leaf = {}
            note = f"not available ({t.claim} result missing or lacks it)"
        elif leaf.get("note"):
            note = leaf["note"]
        rows.append({"study": study, "quantity": t.quantity, "paper": t.paper, "ours": _num(leaf.get("estimate")),
                     "ci_low": _num(leaf.get("ci_low")), "ci_high": _num(leaf.get("ci_high")), "note": note})
    return rows


def _f(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def to_markdown(df: pd.DataFrame) -> str:
    cols = ["study", "prereg", "claim", "title", "estimate", "ci_low", "ci_high", "threshold", "verdict",
            "paper_verdict", "agrees", "n"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        cells = [_f(r[c]) if c in ("estimate", "ci_low", "ci_high", "threshold") else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _tex_escape(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"), ("$", r"\$")):
        s = s.replace(a, b)
    return s


def to_latex(df: pd.DataFrame) -> str:
    lines = [r"\begin{tabular}{lllrrrll}", r"\toprule",
             r"Study & Claim & Title & Estimate & 95\% CI & Threshold & Verdict (paper) & Agrees \\", r"\midrule"]
    for _, r in df.iterrows():
        ci = f"[{_f(r['ci_low'])}, {_f(r['ci_high'])}]"
        lines.append(" & ".join([
            _tex_escape(f"{r['study']} (v{r['prereg']})"), r["claim"].upper(), _tex_escape(str(r["title"])),
            _f(r["estimate"]), ci, _f(r["threshold"]),
            _tex_escape(f"{r['verdict']} ({r['paper_verdict']})"), str(r["agrees"]),
        ]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def accuracy_tables(paths: list[Path]) -> pd.DataFrame:
    """The studies' accuracy tables, with a leading study column (the folder holding each table)."""
    frames = []
    for p in paths:
        if not p.is_file():
            raise AnalysisError(f"{p}: missing accuracy table")
        frames.append(pd.read_csv(p).assign(study=p.parent.name))
    if not frames:
        return pd.DataFrame(columns=["study"])
    table = pd.concat(frames, ignore_index=True)
    return table[["study", *[c for c in table.columns if c != "study"]]]


def aggregate(paths: list[Path], out_dir: Path, accuracy: list[Path] | None = None) -> list[Path]:
    """Write the tables; returns their paths."""
    results = load_results(paths)
    if not results:
        raise AnalysisError("no claim results given")
    out_dir.mkdir(parents=True, exist_ok=True)
    table = claims_table(results)
    outputs = {
        "claims.csv": table.to_csv(index=False),
        "claims.md": to_markdown(table),
        "claims.tex": to_latex(table),
        "reproduction.csv": reproduction_table(results).to_csv(index=False),
        "claims_by_model.csv": by_model_table(results).to_csv(index=False),
        "claims_by_policy.csv": by_policy_table(results).to_csv(index=False),
    }
    if accuracy is not None:
        outputs["accuracy.csv"] = accuracy_tables(accuracy).to_csv(index=False)
    for name, text in outputs.items():
        write_text_atomic(text, out_dir / name)
    return [out_dir / n for n in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcert-aggregate", description="Claim results -> paper tables.")
    parser.add_argument("results", nargs="*", type=Path, help="claim JSON files (default: all in --claims-dir)")
    parser.add_argument("--claims-dir", type=Path, default=Path("results/claims"))
    parser.add_argument("--out-dir", type=Path, default=Path("results/tables"))
    parser.add_argument("--accuracy", type=Path, nargs="*", default=None, help="per-study accuracy.csv tables")
    args = parser.parse_args(argv)
    try:
        paths = args.results or sorted(args.claims_dir.glob("*.json"))
        if not paths:
            raise AnalysisError(f"{args.claims_dir}: no claim results (*.json)")
        for p in aggregate(paths, args.out_dir, args.accuracy):
            print(f"wrote {p}")
    except AnalysisError as exc:
        print(f"kvcert-aggregate: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

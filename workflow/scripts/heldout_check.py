"""A certified-budgets held-out check (rule ``certified_budgets_check``): its locked spec
(``preregistration/exploratory/<scale>.yaml``, frozen by ``kvcert-prereg lock --exploratory <scale>``) decided by
kvcert.analysis.heldout on the check's ``summary.csv`` against the spec's reference. Writes ``check.csv`` (one row per
model and target configuration) and ``decisions.csv`` (the spec's decisions, e.g. check 3's floor). Exploratory: no
claim reads it. The criterion and its columns: kvcert.analysis.heldout.
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import pandas as pd

from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.heldout import check_table, decisions, load_spec, verify_spec_lock
from kvcert.atomic import write_text_atomic


def main(summary: Path, scale: str, root: Path, check: dict, out: Path, decisions_out: Path) -> None:
    """summary: the check's summary.csv; scale: its scale, whose spec decides; check: the scale's ``check`` keys,
    which must name what the spec names (against, fixed, margin)."""
    try:
        spec = load_spec(root, scale)
        verify_spec_lock(root, scale)
        named = {"against": spec.against, "fixed": spec.fixed, "margin": spec.margin}
        differ = [k for k, v in named.items() if k in check and (float(check[k]) if k == "margin" else
                                                                  str(check[k])) != v]
        if differ:
            raise AnalysisError(f"{scale}.yaml: check.{differ[0]}={check[differ[0]]!r} differs from the locked "
                                f"{spec.path}'s {named[differ[0]]!r}")
        reference = Path(root) / spec.against
        if not reference.is_file():
            raise AnalysisError(f"{spec.path}: against={spec.against}: no such file (the reference summary.csv)")
        table = check_table(pd.read_csv(summary), pd.read_csv(reference), spec, spec.against)
        decided = decisions(table, spec)
    except AnalysisError as exc:
        raise SystemExit(f"heldout_check: {exc}") from None
    write_text_atomic(table.round(6).to_csv(index=False), Path(out))
    write_text_atomic(decided.to_csv(index=False), Path(decisions_out))


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(Path(sm.input.summary), str(sm.params.scale), Path.cwd(), dict(sm.params.check), Path(sm.output.check),
         Path(sm.output.decisions))

"""The certificate diagnostics' figure (rule ``certificate_flags_figure``), drawn from a certified-budgets study's
``certificate_flags.csv`` by kvcert.analysis.certificate_diagnostics.flags_figure, the function the diagnostics
notebook shows it with: a committed study's figure is redrawn from its committed table (``make redraw
SCALE=<name>``). Exploratory, added after the study's held-out checks were read.
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402

from kvcert.analysis.certificate_diagnostics import flags_figure  # noqa: E402
from kvcert.analysis.errors import AnalysisError  # noqa: E402
from kvcert.analysis.figures import save_figure  # noqa: E402

COLUMNS = ["model", "sizing", "family", "layer", "above_high", "silent_high"]


def main(flags_csv: Path, delta: float, png: Path, pdf: Path) -> None:
    flags_csv = Path(flags_csv)
    if not flags_csv.is_file():
        raise AnalysisError(f"{flags_csv}: missing (the diagnostics notebook writes it)")
    flags = pd.read_csv(flags_csv)
    missing = [c for c in COLUMNS if c not in flags.columns]
    if missing:
        raise AnalysisError(f"{flags_csv}: no column {', '.join(missing)}")
    save_figure(flags_figure(flags, delta), png, pdf)


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(Path(sm.input.flags), float(sm.params.delta), Path(sm.output.png), Path(sm.output.pdf))

"""The certificate diagnostics' figure (rule ``certificate_flags_figure``), drawn from a certified-budgets study's
``certificate_flags.csv`` by kvcert.analysis.certificate_diagnostics.flags_figure, the function the diagnostics
notebook shows it with: a committed study's figure is redrawn from its committed table (``make redraw
SCALE=<name>``). Exploratory, added after the study's held-out checks were read.
"""

# No `from __future__` import: Snakemake runs this file through `script:`, which puts its own preamble first.
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from kvcert.analysis.certificate_diagnostics import flags_figure  # noqa: E402
from kvcert.analysis.exploratory import read_study_table  # noqa: E402
from kvcert.analysis.figures import save_figure  # noqa: E402

COLUMNS = ["model", "sizing", "family", "layer", "above_high", "silent_high"]


def main(flags_csv: Path, delta: float, png: Path, pdf: Path) -> None:
    flags = read_study_table(flags_csv, COLUMNS, "the diagnostics notebook")
    save_figure(flags_figure(flags, delta), png, pdf)


if __name__ == "__main__":  # run by Snakemake's script directive
    sm = snakemake  # noqa: F821
    main(Path(sm.input.flags), float(sm.params.delta), Path(sm.output.png), Path(sm.output.pdf))

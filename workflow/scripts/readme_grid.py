"""README's results grid: one row per pre-registered claim, one column per study of the claims table
(estimate [95% CI] and verdict), and the paper's verdict beside them. The grid is written as markdown and,
given a README, replaces what the README holds between its two grid markers, so it is never typed by hand.

Run by rule ``readme_grid`` (workflow/rules/tables.smk), or by hand:
    python workflow/scripts/readme_grid.py results/claims.csv --out results/claims_grid.md --readme README.md
"""

import argparse
import csv
import sys
from collections import Counter
from pathlib import Path

from kvcert.atomic import write_text_atomic

START = "<!-- results-grid:start -->"
END = "<!-- results-grid:end -->"
COLUMNS = {"study", "prereg", "claim", "title", "component", "estimate", "ci_low", "ci_high", "threshold", "verdict",
           "paper_verdict"}


def _number(text):
    """A claims-table float as the markdown claims table prints it (4 significant digits)."""
    return f"{float(text):.4g}"


def render(claims_csv):
    """The grid (markdown, ending in a newline) of ``claims_csv``'s rows, studies in the table's order."""
    with Path(claims_csv).open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = sorted(COLUMNS - set(reader.fieldnames or ()))
        rows = list(reader)
    if missing:
        raise ValueError(f"{claims_csv}: missing column(s) {', '.join(missing)}")
    if not rows:
        raise ValueError(f"{claims_csv}: no rows")
    studies = list(dict.fromkeys(r["study"] for r in rows))
    claims = sorted(dict.fromkeys(r["claim"] for r in rows), key=lambda c: int(c.lstrip("c")))
    by_key = {(r["study"], r["claim"]): r for r in rows}
    prereg = {r["study"]: r["prereg"] for r in rows}
    header = ["claim", "binding component, threshold",
              *(f"{s} (prereg {prereg[s]})" for s in studies), "paper"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for claim in claims:
        present = [by_key[(s, claim)] for s in studies if (s, claim) in by_key]
        papers = {r["paper_verdict"] for r in present}
        if len(papers) != 1:
            raise ValueError(f"{claims_csv}: claim {claim} has paper verdicts {sorted(papers)} in different rows")
        # The component most studies decide on; a study deciding on another one names it in its own cell.
        usual = Counter((r["component"], r["threshold"]) for r in present).most_common(1)[0][0]
        cells = [f"**{claim}** {present[0]['title']}", f"`{usual[0]}`, {_number(usual[1])}"]
        for study in studies:
            r = by_key.get((study, claim))
            if r is None:
                cells.append("—")
                continue
            own = "" if (r["component"], r["threshold"]) == usual else \
                f"`{r['component']}`, {_number(r['threshold'])}: "
            cells.append(f"{own}{_number(r['estimate'])} [{_number(r['ci_low'])}, {_number(r['ci_high'])}]"
                         f"<br>**{r['verdict']}**")
        cells.append(papers.pop())
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def splice(readme_text, grid):
    """``readme_text`` with everything between the grid markers replaced by ``grid``."""
    if readme_text.count(START) != 1 or readme_text.count(END) != 1:
        raise ValueError(f"README must hold {START} and {END} once each")
    if readme_text.index(END) < readme_text.index(START):
        raise ValueError(f"README's {START} must come before {END}")
    head, rest = readme_text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{grid}{END}{tail}"


def write(claims_csv, out, readme=None):
    grid = render(claims_csv)
    write_text_atomic(grid, out)
    if readme:
        text = Path(readme).read_text()
        spliced = splice(text, grid)
        if spliced != text:  # an unchanged README keeps its timestamp
            write_text_atomic(spliced, readme)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("claims_csv")
    parser.add_argument("--out", required=True, help="the grid as a markdown file")
    parser.add_argument("--readme", help="a README whose grid markers receive the grid")
    args = parser.parse_args(argv)
    try:
        write(args.claims_csv, args.out, args.readme)
    except (OSError, ValueError) as err:
        print(f"readme_grid: error: {err}", file=sys.stderr)
        return 1
    return 0


if "snakemake" in globals():
    write(snakemake.input.claims, snakemake.output.grid, snakemake.params.readme or None)  # noqa: F821
elif __name__ == "__main__":
    sys.exit(main())

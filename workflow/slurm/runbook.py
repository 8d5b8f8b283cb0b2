"""The runbook of docs/cluster.md as a script: what `make rehearse-paper` runs, read from the page itself.

The page's section "## Runbook" holds numbered steps (``### 1. Title``), each with one or more ```bash blocks. The
rehearsal runs every block in order, as one bash script, except blocks directly preceded by a directive:

- ``<!-- rehearse: site -->``: the site's own settings (account, partition, paths); the rehearsal runs its own
  settings file instead (``--site``, workflow/slurm/rehearse-site.sh);
- ``<!-- rehearse: skip REASON -->``: a command the one-node rehearsal cannot run (an interactive terminal, a copy
  between two sites); the reason is printed where the block would have run.

So the page cannot drift from what is rehearsed: a command that stops working fails the rehearsal, and a command
the page drops is no longer run.

    python workflow/slurm/runbook.py --list                     # the steps and what the rehearsal does with each
    python workflow/slurm/runbook.py --script --site FILE       # the bash script the rehearsal runs
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "cluster.md"
SECTION = "## Runbook"
STEP = re.compile(r"^### (\d+)\. (.+?)\s*$")
DIRECTIVE = re.compile(r"^<!-- rehearse: (site|skip)\b\s*(.*?)\s*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")


class RunbookError(ValueError):
    """The page's runbook cannot be read as steps; the message names the page and the line."""


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    code: str
    action: str = "run"  # run | site | skip
    reason: str = ""


@dataclass
class Step:
    number: int
    title: str
    line: int
    blocks: list[Block] = field(default_factory=list)


def read_steps(page: Path = PAGE) -> list[Step]:
    """The runbook's steps in page order. Raises RunbookError naming the page and line on a malformed runbook."""
    try:
        lines = page.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise RunbookError(f"{page}: cannot read ({err.strerror})") from None
    where = lambda n: f"{page.name}:{n}"  # noqa: E731 - a one-line label
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == SECTION)
    except StopIteration:
        raise RunbookError(f"{page.name}: no '{SECTION}' section") from None
    steps: list[Step] = []
    directive: tuple[str, str, int] | None = None
    i = start + 1
    while i < len(lines) and not (lines[i].startswith("## ") and not lines[i].startswith("### ")):
        line = lines[i]
        if line.startswith("### "):
            match = STEP.match(line)
            if not match:
                raise RunbookError(f"{where(i + 1)}: a runbook heading must read '### N. Title', not {line!r}")
            number = int(match[1])
            if number != len(steps) + 1:
                raise RunbookError(f"{where(i + 1)}: step {number} follows step {len(steps)}; number them 1, 2, 3, ...")
            steps.append(Step(number, match[2], i + 1))
        elif (match := DIRECTIVE.match(line.strip())) is not None:
            if match[1] == "skip" and not match[2]:
                raise RunbookError(f"{where(i + 1)}: 'rehearse: skip' needs a reason")
            directive = (match[1], match[2], i + 1)
        elif line.strip().startswith("<!-- rehearse"):
            raise RunbookError(f"{where(i + 1)}: unknown directive {line.strip()!r}; known: 'rehearse: site', "
                               "'rehearse: skip REASON'")
        elif (match := FENCE.match(line)) is not None:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise RunbookError(f"{where(i + 1)}: a code block that never closes")
            if match[1] in ("bash", "sh"):
                if not steps:
                    raise RunbookError(f"{where(i + 1)}: a command block before step 1")
                block = Block(i + 1, "\n".join(lines[i + 1:end]))
                if directive is not None:
                    block.action, block.reason = directive[0], directive[1]
                steps[-1].blocks.append(block)
            directive = None
            i = end
        elif line.strip() and directive is not None:
            raise RunbookError(f"{where(directive[2])}: a directive must stand directly before a ```bash block")
        i += 1
    if not steps:
        raise RunbookError(f"{page.name}: the '{SECTION}' section has no '### 1. ...' step")
    for step in steps:
        if not step.blocks:
            raise RunbookError(f"{where(step.line)}: step {step.number} ({step.title}) has no ```bash block")
    return steps


def script(steps: list[Step], site: Path | None) -> str:
    """One bash script running the steps' blocks in order; a site block runs ``site`` instead."""
    out = ["#!/usr/bin/env bash", "# Generated from docs/cluster.md's runbook by workflow/slurm/runbook.py.",
           "set -euo pipefail"]
    for step in steps:
        out.append(f"echo {shlex.quote(f'runbook: step {step.number}. {step.title}')} >&2")
        for block in step.blocks:
            if block.action == "run":
                out.append(block.code)
            elif block.action == "site":
                if site is None:
                    raise RunbookError(f"{PAGE.name}:{block.line}: a site block and no --site file to run instead")
                out.append(f"source {shlex.quote(str(site))}  # instead of the page's site settings")
            else:
                out.append(f"echo {shlex.quote(f'runbook:   not rehearsed: {block.reason}')} >&2")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=Path, default=PAGE)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="the steps and what the rehearsal does with each block")
    mode.add_argument("--script", action="store_true", help="print the bash script the rehearsal runs")
    parser.add_argument("--site", type=Path, help="the settings file run instead of the page's site block")
    args = parser.parse_args(argv)
    try:
        steps = read_steps(args.page)
        if args.script:
            if args.site is not None and not args.site.is_file():
                raise RunbookError(f"--site {args.site}: no such file")
            sys.stdout.write(script(steps, args.site.resolve() if args.site else None))
        else:
            for step in steps:
                actions = ", ".join(b.action + (f" ({b.reason})" if b.reason else "") for b in step.blocks)
                print(f"{step.number}. {step.title}: {actions}")
    except RunbookError as err:
        print(f"runbook: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/cluster.md's runbook is what `make rehearse-paper` runs (workflow/slurm/runbook.py): the parser on
hand-written pages, its refusals, and the real page read as the rehearsal reads it. Fast: no model, no cluster."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = ROOT / "workflow" / "slurm" / "runbook.py"
REHEARSE = ROOT / "workflow" / "slurm" / "rehearse-paper.sh"
SITE = ROOT / "workflow" / "slurm" / "rehearse-site.sh"


def runbook():
    spec = importlib.util.spec_from_file_location("runbook", RUNBOOK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


PAGE = """# Title

Intro with a block that is not part of the runbook:

```bash
echo before
```

## Runbook

### 1. Settings

<!-- rehearse: site -->
```bash
export SCALE=paper
```

### 2. Work

```bash
echo one
echo two
```

<!-- rehearse: skip needs a terminal -->
```bash
tmux new -s x
```

```text
not a command
```

## After

```bash
echo after
```
"""


def test_steps_blocks_and_directives(tmp_path):
    page = tmp_path / "cluster.md"
    page.write_text(PAGE)
    steps = runbook().read_steps(page)
    assert [(s.number, s.title) for s in steps] == [(1, "Settings"), (2, "Work")]
    assert [b.action for b in steps[0].blocks] == ["site"]
    assert [(b.action, b.reason) for b in steps[1].blocks] == [("run", ""), ("skip", "needs a terminal")]
    assert steps[1].blocks[0].code == "echo one\necho two"


def test_script_runs_the_page_in_order(tmp_path):
    page = tmp_path / "cluster.md"
    page.write_text(PAGE)
    site = tmp_path / "site.sh"
    site.write_text("export SCALE=rehearse\necho site-settings\n")
    module = runbook()
    text = module.script(module.read_steps(page), site)
    result = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["site-settings", "one", "two"]  # not 'before', 'after' nor the skipped tmux
    assert "not rehearsed: needs a terminal" in result.stderr
    assert result.stderr.index("step 1. Settings") < result.stderr.index("step 2. Work")


def test_a_failing_command_stops_the_rehearsal(tmp_path):
    page = tmp_path / "cluster.md"
    page.write_text(PAGE.replace("echo one", "false"))
    module = runbook()
    text = module.script(module.read_steps(page), tmp_path / "unused.sh")
    result = subprocess.run(["bash", "-c", text.replace("source", "true")], capture_output=True, text=True)
    assert result.returncode != 0 and "two" not in result.stdout


@pytest.mark.parametrize("edit, message", [
    (("### 2. Work", "### 3. Work"), "step 3 follows step 1"),
    (("### 2. Work", "### Work"), "must read '### N. Title'"),
    (("<!-- rehearse: skip needs a terminal -->", "<!-- rehearse: skip -->"), "needs a reason"),
    (("<!-- rehearse: site -->", "<!-- rehearse: maybe -->"), "unknown directive"),
    (("## Runbook", "## Steps"), "no '## Runbook' section"),
    (("<!-- rehearse: site -->\n```bash", "<!-- rehearse: site -->\nprose\n```bash"), "directly before"),
])
def test_a_malformed_runbook_names_its_line(tmp_path, edit, message):
    page = tmp_path / "cluster.md"
    page.write_text(PAGE.replace(*edit))
    result = subprocess.run([sys.executable, str(RUNBOOK), "--list", "--page", str(page)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1


def test_the_pages_runbook_is_what_the_rehearsal_runs():
    module = runbook()
    steps = module.read_steps()
    assert len(steps) >= 8, "the runbook lost steps"
    titles = " ".join(s.title.lower() for s in steps)
    for word in ("stage", "install", "device check", "pilot", "submit", "watch", "resume", "collect", "verify"):
        assert word in titles, f"docs/cluster.md's runbook has no step about '{word}'"
    assert any(b.action == "site" for s in steps for b in s.blocks), "no site block for the rehearsal to replace"
    rehearse = REHEARSE.read_text()
    assert "runbook.py" in rehearse and "--script" in rehearse, "rehearse-paper.sh no longer runs the page"
    assert SITE.is_file()
    text = module.script(steps, SITE)
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0, "the runbook's commands are not valid bash"
    ran = [b for s in steps for b in s.blocks if b.action == "run"]
    assert len(ran) >= len(steps) - 3, "most steps must be rehearsed, not skipped"

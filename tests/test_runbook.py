"""docs/cluster.md's runbook is what `make rehearse-paper` runs (workflow/slurm/runbook.py): the parser on
hand-written pages, its refusals, and the real page read as the rehearsal reads it. Fast: no model, no cluster."""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = ROOT / "workflow" / "slurm" / "runbook.py"
REHEARSE = ROOT / "workflow" / "slurm" / "rehearse-paper.sh"
SITE = ROOT / "workflow" / "slurm" / "rehearse-site.sh"
SLURM = ROOT / "workflow" / "slurm"


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


VAR = re.compile(r"\$\{?([A-Z][A-Z0-9_]*)")
EXPORT = re.compile(r"^\s*export\s+(.+?)(?:\s+#.*)?$")
# Set by the shell or by the files the runbook sources (the stage's kvcert-stage.env, the environment's activate).
NOT_SITE = {"USER", "HOME", "PATH", "PWD"}


def exported(text):
    """Names a bash text exports (``export A=1 B=2``), in order."""
    names = []
    for line in text.splitlines():
        if (match := EXPORT.match(line)) is not None:
            names += [word.split("=")[0] for word in shlex.split(match[1], comments=True) if "=" in word]
    return names


def test_every_variable_the_runbook_uses_is_a_site_setting():
    """A command that names a variable nobody sets runs with it empty: the page's site block must set every
    variable its commands use, and the rehearsal's site file the same ones."""
    steps = runbook().read_steps()
    site = next(b.code for s in steps for b in s.blocks if b.action == "site")
    used = {name for s in steps for b in s.blocks if b.action != "site" for name in VAR.findall(b.code)} - NOT_SITE
    assert used, "no variable found: the pattern is broken"
    assert used <= set(exported(site)), f"the page's site block does not set {sorted(used - set(exported(site)))}"
    rehearsal = set(exported(SITE.read_text()))
    assert used <= rehearsal, f"workflow/slurm/rehearse-site.sh does not set {sorted(used - rehearsal)}"


def test_srun_asks_for_the_account_and_partition_itself():
    """srun reads none of the KVCERT_SLURM_* variables: on a site without a default partition or account, the
    request of the GPU steps must name both."""
    steps = runbook().read_steps()
    site = next(b.code for s in steps for b in s.blocks if b.action == "site")
    gpu = next(shlex.split(line.split("=", 1)[1], comments=True)[0] for line in site.splitlines()
               if line.startswith("export GPU="))
    assert "-A" in gpu.split() and "-p" in gpu.split(), gpu
    srun = [line for s in steps for b in s.blocks if b.action == "run" for line in b.code.splitlines()
            if line.lstrip().startswith("srun")]
    assert srun and all(line.split()[1] == "$GPU" for line in srun), srun


def test_project_commands_come_after_the_environment_is_activated():
    """The page never puts the environment on PATH but by `source .venv/bin/activate`: a console script of the
    project (or snakemake, or the controller job, which inherits PATH) before that line fails as written."""
    steps = runbook().read_steps()
    activated = False
    for step in steps:
        for block in step.blocks:
            for line in block.code.splitlines():
                command = line.split("#")[0].strip()
                if command.startswith("source .venv/bin/activate"):
                    activated = True
                words = command.split()
                if words and (words[0].startswith("kvcert-") or words[0] in ("snakemake", "sbatch", "python")):
                    assert activated, f"step {step.number}: '{command}' runs before the environment is activated"
    assert activated, "the runbook never activates the environment"


def test_every_step_says_what_success_looks_like():
    page = runbook().PAGE.read_text().splitlines()
    steps = runbook().read_steps()
    ends = [s.line for s in steps[1:]] + [next(i for i in range(steps[-1].line, len(page) + 1)
                                              if i == len(page) or page[i].startswith("## "))]
    for step, end in zip(steps, ends):
        text = "\n".join(page[step.line:end - 1])
        assert "Success:" in text, f"docs/cluster.md step {step.number} ({step.title}) does not say what success looks like"


def partitions(value):
    """cluster-up.sh's partition lines for KVCERT_SLURM_PARTITIONS=value (the function alone, no cluster)."""
    script = (f"source {shlex.quote(str(SLURM / 'common.sh'))}\n"
              f"eval \"$(sed -n '/^partition_lines() {{/,/^}}/p' {shlex.quote(str(SLURM / 'cluster-up.sh'))})\"\n"
              "partition_lines")
    env = {"PATH": "/usr/bin:/bin", "KVCERT_SLURM_PARTITIONS": value}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)


def test_cluster_partitions_follow_the_setting():
    result = partitions("compute gpu-a100*")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "PartitionName=compute Nodes=localhost Default=NO MaxTime=INFINITE State=UP",
        "PartitionName=gpu-a100 Nodes=localhost Default=YES MaxTime=INFINITE State=UP"]
    # no '*': no default partition, as on a site where every job names its own
    assert "Default=YES" not in partitions("compute gpu").stdout
    bad = partitions("compute gpu;rm")
    assert bad.returncode != 0 and "'gpu;rm' is not a partition name" in bad.stderr and bad.stderr.count("\n") == 1

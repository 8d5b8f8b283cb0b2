"""Planted bugs that the test tiers must catch (tests/mutations.yaml).

Each mutant replaces one snippet of src/kvcert (it must occur exactly once) in a scratch copy of the package,
never in the checkout, and runs only the tests the list names against that copy (PYTHONPATH first, so that the
test process and every command it starts, kvcert-run included, import the mutant). The mutant is caught when
at least one of them fails; none of them may be skipped. Every listed test must be selected by ``make test``
or ``make test-full`` (their marker expressions are read from the Makefile), so that a caught mutant is a bug
that CI catches. ``make mutations`` runs this file alone and prints which tests caught each mutant.

The mutants run in make test-full (marker slow); the list's own checks (each snippet present once, each test
in a tier) are quick and run in make test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MUTATIONS = yaml.safe_load((ROOT / "tests" / "mutations.yaml").read_text())
FIELDS = {"id", "what", "file", "original", "mutant", "tests"}


def tier_expression(variable: str) -> str:
    """The marker expression a Makefile variable (TEST_MARKERS: make test's, TEST_FULL_MARKERS: make
    test-full's) holds."""
    found = re.findall(rf"^{variable}\s*[:?]?=\s*(.+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert len(found) == 1, f"Makefile: {variable} must be set once"
    return found[0].strip()


MARKERS_PLUGIN = """
import json, os

def pytest_collection_modifyitems(session, config, items):
    with open(os.environ["KVCERT_COLLECTED_MARKERS"], "w") as f:
        json.dump({item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in items}, f)
"""


def _markers(node_ids: list[str], tmp: Path) -> dict[str, set[str]]:
    """{node id: its marker names} of every test in the files of ``node_ids``, from one collection."""
    (tmp / "collected_markers.py").write_text(MARKERS_PLUGIN)
    out = tmp / "markers.json"
    env = {**os.environ, "KVCERT_COLLECTED_MARKERS": str(out),
           "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    files = sorted({node.split("::")[0] for node in node_ids})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
                           "collected_markers", *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {node: set(names) for node, names in json.loads(out.read_text()).items()}


def _selected(expression: str, markers: set[str]) -> bool:
    """Whether ``pytest -m expression`` selects a test with these markers."""
    return Expression.compile(expression).evaluate(lambda name, **kwargs: not kwargs and name in markers)


def test_every_mutation_names_a_snippet_present_once_and_tests_that_exist():
    assert len({m["id"] for m in MUTATIONS}) == len(MUTATIONS)
    for m in MUTATIONS:
        assert set(m) == FIELDS, (m.get("id"), set(m) ^ FIELDS)
        path = ROOT / m["file"]
        assert m["file"].startswith("src/kvcert/") and path.is_file(), m["id"]
        text = path.read_text()
        assert text.count(m["original"]) == 1, f"{m['id']}: the original snippet must occur once in {m['file']}"
        assert m["mutant"] != m["original"] and m["tests"], m["id"]
        for node in m["tests"]:
            test_file, _, name = node.partition("::")
            source = (ROOT / test_file).read_text()
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, flags=re.M), f"{m['id']}: {node}"
    ids = {m["id"] for m in MUTATIONS}
    # The bugs issue 59 names, and the ones added beside them.
    assert {"hajek-offset-sign", "gqa-averaging", "snapkv-window", "h2o-last-chunk", "item-signal-cert-max",
            "certificate-delta", "variance-without-one-minus-pi", "poisson-tail-target", "allocator-rounding"} <= ids


@pytest.mark.slow  # make test-full, which CI runs: it collects the whole suite twice
def test_every_listed_test_runs_in_make_test_or_make_test_full(tmp_path):
    nodes = sorted({node for m in MUTATIONS for node in m["tests"]})
    collected = _markers(nodes, tmp_path)
    tiers = [tier_expression("TEST_MARKERS"), tier_expression("TEST_FULL_MARKERS")]
    for node in nodes:  # a test listed without its parameters stands for each of them
        cases = {c: marks for c, marks in collected.items() if c == node or c.startswith(node + "[")}
        assert cases, f"{node} is not collected"
        for case, marks in cases.items():
            assert any(_selected(tier, marks) for tier in tiers), f"{case} ({sorted(marks)}) is in neither tier"
    # The two tiers do not overlap, and the slow marker is what separates them.
    assert not _selected(tiers[0], {"slow"}) and _selected(tiers[1], {"slow"}) and _selected(tiers[0], {"smollm2"})


def _outcomes(report: Path) -> dict[str, str]:
    """{test name: passed | failed | skipped} from a JUnit report (errors count as failed)."""
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        name = f"{case.get('classname')}::{case.get('name')}"
        outcomes[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m["id"] for m in MUTATIONS])
def test_the_mutant_is_caught(mutation, tmp_path):
    scratch = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "kvcert", scratch / "kvcert", ignore=shutil.ignore_patterns("__pycache__"))
    target = scratch / Path(mutation["file"]).relative_to("src")
    text = target.read_text()
    assert text.count(mutation["original"]) == 1, mutation["id"]
    target.write_text(text.replace(mutation["original"], mutation["mutant"]))
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line",
                           f"--junitxml={report}", *mutation["tests"]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    outcomes = _outcomes(report)
    caught = sorted(name for name, outcome in outcomes.items() if outcome == "failed")
    skipped = sorted(name for name, outcome in outcomes.items() if outcome == "skipped")
    print(f"\n{mutation['id']}: caught by {len(caught)} of {len(outcomes)}: {', '.join(caught) or 'none'}")
    assert outcomes, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert skipped == [], f"{mutation['id']}: listed tests skipped: {skipped}"
    assert caught, f"{mutation['id']} ({mutation['what']}) survived its tests:\n{proc.stdout[-3000:]}"
    # Failed tests (1), not a collection error or an interrupted run (2 and above).
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]

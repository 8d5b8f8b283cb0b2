"""README.md and docs/ against the committed results and the code: every number or name they state that a
file or a module can decide is checked here, so that an edit of one without the other fails. Fast: no model,
no DAG; reads results/, configs/scales/, the Makefile, pyproject.toml and a few kvcert modules."""

import csv
import functools
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from kvcert.analysis.prereg import versions
from kvcert.scales import exploratory, load_scale, scales_folder, studies
from helpers.scripts import load_module, render_docs, workflow_script

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = versions(ROOT)
README = ROOT / "README.md"
DOCS = ROOT / "docs"
STUDY_DOCS = DOCS / "studies"
SCALES = scales_folder(ROOT)
RESULTS = ROOT / "results"
PAGES = [README, ROOT / "benchmarks" / "README.md", *sorted(DOCS.rglob("*.md"))]
# Names the docs use on purpose although no file defines them: the bad input of docs/errors.md, the user's own
# derived scale of docs/cluster.md, and hajek_attention's keyword argument `scale=None` (docs/library.md).
NOT_A_SCALE = {"huge", "mysite", "None"}
NOT_A_SCRIPT = {"kvcert-calibration",  # the calibration file's format name (docs/METHOD.md)
                "kvcert-controller",  # the controller job's name and log (workflow/slurm/controller.sbatch)
                "kvcert-text-generation",  # the transformers pipeline task kvcert.presses registers
                "kvcert-stage", "kvcert-record"}  # kvcert-stage.env and kvcert-record.json, files the stage writes
NOT_A_PREREG_VERSION = {9}  # docs/errors.md: prereg_version=9 is the example of an unknown version


def text(path):
    return path.read_text(encoding="utf-8")


render_script = render_docs  # one module serves every page's tables


def rows(path):
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def same_shown(value, shown, decimals):
    """Whether ``shown`` (``decimals`` decimals) is ``value`` rounded; ties either way, since a committed table
    may itself hold a rounded value (0.735 may be 0.7352)."""
    return abs(float(value) - shown) <= 0.5 * 10 ** -decimals + 1e-9


def markdown_tables(page):
    """Every markdown table of a page: (header cells, body rows of cells); escaped pipes kept (the renderer's parser,
    on the page less its rows spans' templates: a rows span's key and template are an HTML comment, no table)."""
    body = re.sub(r"<!-- rows:.*?-->\n", "", text(page), flags=re.S)
    return render_script().markdown_tables(body)


# --- README ------------------------------------------------------------------------------------------------


def test_readme_is_short_and_keeps_ci_test_command():
    lines = text(README).splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the issue allows 300"
    section = text(README).split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^make test\b", section, flags=re.M), "README's 'Two commands' section lost `make test`"
    assert "make test" in text(ROOT / ".ci" / "run")


RENDERED = [README, *sorted(STUDY_DOCS.glob("*.md"))]
# A number a reader may meet outside a rendered span: one inside a name (Gemma 3, Llama 3.1, arXiv's id and the
# year of the paper, the Python version), which is no datum.
NAMES = ("Gemma 3", "Llama 3.1", "Llama-3.1", "2607.21475", "2026", "Python ≥ 3.10", "Python 3.11")
NUMBER = re.compile(r"(?<![\w.,])[+−-]?\d[\d,]*(?:\.\d+)?(?![\w]|\.\d)")


@functools.cache
def _scale_and_studies(name):
    """(scale ``name``, its studies), read once per session: every page's check reads every scale, and reading
    one parses each of its cells' overrides."""
    scale = load_scale(name, SCALES)
    return scale, studies(scale)


def applied_yamls(study):
    """The YAML files study ``study`` applies: the scale that made its committed results (one that writes to
    results/ and computes the study, not one that reads it as a record) and, for a pre-registered study, that
    version's document."""
    found = []
    for path in sorted(SCALES.glob("*.yaml")):
        scale, scale_studies = _scale_and_studies(path.stem)
        spec = scale_studies.get(study)
        computes = spec is not None and not spec.get("archived")
        if scale.get("outdir") == "results" and (computes or study in exploratory(scale)):
            found.append(path)
            if computes:
                found.append(ROOT / VERSIONS[spec["prereg"]].document)
    if not found:  # a study named but pending (its amendment a draft): its own scale and that amendment's document
        from kvcert.scales import design_reference

        if any(study in (_scale_and_studies(p.stem)[0].get("pending") or {}) for p in SCALES.glob("*.yaml")):
            design, _ = design_reference(SCALES, study, study)
            return [SCALES / f"{study}.yaml", design.parent / "amendment.yaml"]
    assert len({p for p in found if p.parent == SCALES}) == 1, f"study {study}: want one scale that makes it"
    return found


def yaml_numbers(document):
    """Every number a parsed YAML document states in its keys and values (strings included: an override
    ``n_items=610``, a rule's text), never in its comments, which the parser drops; as absolute values."""
    if isinstance(document, dict):
        return set().union(*map(yaml_numbers, document), *map(yaml_numbers, document.values()))
    if isinstance(document, list):
        return set().union(*map(yaml_numbers, document))
    if isinstance(document, bool) or document is None:
        return set()
    if isinstance(document, (int, float)):
        return {abs(float(document))}
    return {abs(float(m[0].replace(",", ""))) for m in NUMBER.finditer(str(document))}


def parameters(page):
    """The numbers a page may state by hand: the design it reports, not its results. A study page's are the
    numbers of the YAML files its study applies (its scale and its pre-registration version's document: budgets,
    thresholds, margins, item counts, seeds); README's, those of every study with a page."""
    study_pages = [page] if page != README else sorted(STUDY_DOCS.glob("*.md"))
    paths = {path for p in study_pages for path in applied_yamls(p.stem)}
    return set().union(*(yaml_numbers(yaml.safe_load(text(path))) for path in paths))


def prose(page_text):
    """What a page states in prose: without generated blocks, rendered spans, code, link targets and tables
    (tables are checked cell by cell against their sources below)."""
    body = re.sub(r"<!-- block:([\w-]+):start -->.*?<!-- block:\1:end -->", " ", page_text, flags=re.S)
    body = render_script().VALUE.sub(" ", body)
    body = re.sub(r"```.*?```", " ", body, flags=re.S)
    body = re.sub(r"`[^`\n]*`", " ", body)
    body = re.sub(r"\]\([^)]*\)", "]", body)
    for name in NAMES:
        body = body.replace(name, " ")
    return "\n".join(line for line in body.splitlines() if not line.startswith("|"))


@pytest.mark.parametrize("page", RENDERED, ids=[p.name for p in RENDERED])
def test_page_is_its_rendering_from_the_tables(page):
    rendered = render_script().render(text(page), RESULTS, where=page.name)
    assert rendered == text(page), f"{page.relative_to(ROOT)} differs from its rendering: run rule render_docs"


def test_grid_file_is_the_readmes_grid():
    grid = render_script().grid(RESULTS / "claims.csv")
    assert f"<!-- block:results-grid:start -->\n{grid}<!-- block:results-grid:end -->" in text(README)
    assert text(RESULTS / "claims_grid.md") == grid


# A number followed by "%", or the first of a range "55-90%": a percentage, allowed where its fraction is.
PERCENT = re.compile(r"(?:[-–]\d+(?:\.\d+)?)?%")


@pytest.mark.parametrize("page", RENDERED, ids=[p.name for p in RENDERED])
def test_every_prose_number_is_rendered_or_a_parameter(page):
    allowed = parameters(page)
    body = prose(text(page))
    stray = []
    for match in NUMBER.finditer(body):
        number = abs(float(match[0].replace("−", "-").replace(",", "")))
        percent = PERCENT.match(body, match.end()) is not None
        if number in allowed or (percent and number / 100 in allowed):
            continue
        stray.append(" ".join(body[max(0, match.start() - 30):match.end() + 10].split()))
    assert not stray, f"{page.relative_to(ROOT)} states numbers by hand: " + " | ".join(stray)


def test_a_page_may_state_only_its_own_studys_design_by_hand():
    assert [p.relative_to(ROOT).as_posix() for p in applied_yamls("v4")] == [
        "configs/scales/v4.yaml", "preregistration/amendment-4.yaml"]
    assert [p.relative_to(ROOT).as_posix() for p in applied_yamls("v5")] == [
        "configs/scales/v5.yaml", "preregistration/amendment-5/amendment.yaml"]
    assert [p.relative_to(ROOT).as_posix() for p in applied_yamls("v6")] == [
        "configs/scales/default.yaml", "preregistration/amendment-6/amendment.yaml"]
    assert [p.name for p in applied_yamls("sensitivity")] == ["sensitivity.yaml"]
    document = yaml.safe_load("n: 610  # 7,796 in a comment\noverrides: [n_items=126, 'seed 9,501']\nflag: true\n")
    assert yaml_numbers(document) == {610.0, 126.0, 9501.0}
    assert 0.4843 not in parameters(STUDY_DOCS / "v3.md")  # amendment 4's factor is not study v3's design


def test_grid_has_every_study_and_claim_of_the_claims_table():
    grid = render_script().grid(RESULTS / "claims.csv")
    table = rows(RESULTS / "claims.csv")
    header = grid.splitlines()[0]
    for study in {r["study"] for r in table}:
        assert f"| {study} (prereg " in header
    for r in table:  # each study's verdict stands in its claim's row, in the study's column
        line = next(row for row in grid.splitlines() if row.startswith(f"| **{r['claim']}** "))
        column = header.split(" | ").index(next(c for c in header.split(" | ") if c.startswith(f"{r['study']} (")))
        assert f"**{r['verdict']}**" in line.split(" | ")[column]
        assert line.rstrip(" |").endswith(r["paper_verdict"])


def test_render_rewrites_spans_and_blocks_only(tmp_path):
    script = render_script()
    results = tmp_path / "results"
    results.mkdir()
    (results / "claims.csv").write_text(text(RESULTS / "claims.csv").replace("-17.46", "-99.9"))
    page = tmp_path / "page.md"
    page.write_text("# x\nC1 in v1: <!-- value:claims study=v1 claim=c1 ci .1f -->stale<!-- /value --> points.\n"
                    "<!-- block:results-grid:start -->\n| stale |\n<!-- block:results-grid:end -->\nafter 3\n")
    script.write(results, [page], tmp_path / "grid.md")
    out = page.read_text()
    assert "-->−50.0 [−59.2, −40.8]<!-- /value --> points." in out
    assert out.startswith("# x\n") and out.endswith("<!-- block:results-grid:end -->\nafter 3\n")
    assert "| stale |" not in out and (tmp_path / "grid.md").read_text() in out
    before = page.stat().st_mtime_ns
    script.write(results, [page], tmp_path / "grid.md")
    assert page.stat().st_mtime_ns == before  # rendering twice changes nothing


@pytest.mark.parametrize("key,error", [
    ("nosuch study=v1 estimate", "unknown source"),
    ("claims study=v1 estimate", "7 rows match, want 1"),
    ("claims study=v1 claim=c1 nosuch", "no column 'nosuch'"),
    ("claims study=v1 claim=c1", "want one column"),
    ("claim_json study=v1 claim=c9 estimate", "no such claim"),
    ("table model=a accuracy", "table needs file="),
    ("table file=nosuch/summary.csv accuracy", "no such table"),
])
def test_a_bad_key_names_itself(key, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        render_script().render(f"<!-- value:{key} -->1<!-- /value -->", RESULTS)


def test_table_source_reads_any_csv_under_the_results(tmp_path):
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "summary.csv").write_text("model,configuration,accuracy\na,target 0.1,51.25\na,full,60\n")
    out = render_script().render('<!-- value:table file=study/summary.csv model=a configuration="target 0.1" '
                                 'accuracy .1f -->x<!-- /value -->', tmp_path)
    assert out == '<!-- value:table file=study/summary.csv model=a configuration="target 0.1" accuracy .1f -->51.2' \
                  '<!-- /value -->'


def test_by_policy_block_is_claims_by_policy_per_configuration(tmp_path):
    """The block reads results/claims_by_policy.csv (synthetic rows here): one line per (scorer, allocator, share),
    C2 per budget, C3's coverage and Spearman, the median certificate / true error; a model suffix selects its rows."""
    header = "study,claim,model,policy,allocator,head_fraction,budget,component,estimate,ci_low,ci_high,threshold," \
             "verdict,policy_verdict,cert_over_true_err_median\n"
    body = ("v9,c2,pooled,tova,uniform,0.8,0.25,\"poisson_minus_topk[tova,uniform,0.8,0.25]\",-2.5,-6,1,-1,inconclusive,"
            "inconclusive,\nv9,c3,pooled,tova,uniform,0.8,,\"coverage[tova,uniform,0.8]\",0.97,0.96,0.98,0.95,supported,"
            "supported,3.25\nv9,c3,smollm2,tova,uniform,0.8,,\"coverage[tova,uniform,0.8]\",0.9,0.8,0.99,0.95,"
            "inconclusive,inconclusive,2\n")
    (tmp_path / "claims_by_policy.csv").write_text(header + body)
    page = "<!-- block:by-policy-v9:start -->\n<!-- block:by-policy-v9:end -->"
    lines = render_script().render(page, tmp_path).splitlines()
    assert lines[1].startswith("| scorer | allocator | share | C2 at 0.25 (points) | C3 coverage |")
    assert lines[3] == "| tova | uniform | 0.8 | −2.5 [−6.0, 1.0] inconclusive | 0.970 [0.960, 0.980] supported | — | 3.25 |"
    per_model = render_script().render(page.replace("v9", "v9-smollm2"), tmp_path).splitlines()
    assert per_model[3].split(" | ")[3] == "0.900 [0.800, 0.990] inconclusive"
    with pytest.raises(ValueError, match="no rows of study 'v8'"):  # DocError
        render_script().render(page.replace("v9", "v8"), tmp_path)


def test_grid_names_a_missing_column(tmp_path):
    bad = tmp_path / "claims.csv"
    bad.write_text("study,claim\nv1,c1\n")
    with pytest.raises(ValueError, match=r"claims.csv: missing column\(s\) ci_high"):
        render_script().grid(bad)


def test_grid_shows_an_undefined_estimate_as_na():
    """A smoke or rehearsal scale's claims.csv leaves an undefined estimate and interval empty (an empty class):
    the grid shows n/a, as every scale's DAG renders its grid."""
    grid = render_script().grid(ROOT / "results" / "smoke-reference" / "claims.csv")
    with open(ROOT / "results" / "smoke-reference" / "claims.csv", newline="") as f:
        empty = [r for r in csv.DictReader(f) if r["estimate"] == ""]
    assert empty, "the smoke reference has no undefined estimate: this test shows nothing"
    row = next(line for line in grid.splitlines() if line.startswith(f"| **{empty[0]['claim']}**"))
    assert "n/a [n/a, n/a]<br>**inconclusive**" in row


def test_render_rule_is_the_one_writer_of_the_pages():
    rules = "\n".join(text(p) for p in (ROOT / "workflow" / "rules").glob("*.smk"))
    assert rules.count("rule render_docs:") == 1 and rules.count('"../scripts/render_docs.py"') == 1
    assert 'f"{OUT}/claims_grid.md"' in text(ROOT / "Snakefile")  # part of the default target


# --- names: studies, scales, prereg versions, make targets, console scripts ---------------------------------


def test_one_study_page_per_study_of_the_default_scale():
    default = set(studies(load_scale("default", SCALES)))
    pending = set(load_scale("default", SCALES).get("pending") or {})  # named, awaiting its lock: a page, no results
    pages = {p.stem for p in STUDY_DOCS.glob("*.md")} - pending
    explore = {name for scale in SCALES.glob("*.yaml") for name in exploratory(load_scale(scale.stem, SCALES))}
    marked = {p.stem for p in STUDY_DOCS.glob("*.md") if "(exploratory)" in text(p).splitlines()[0]}
    assert pages - marked == default, "docs/studies/ must hold one page per study of configs/scales/default.yaml"
    assert marked <= explore, f"pages marked exploratory that are no exploratory study: {sorted(marked - explore)}"
    assert {r["study"] for r in rows(RESULTS / "claims.csv")} == default
    for study in default:
        assert f"docs/studies/{study}.md" in text(README)


def test_named_studies_exist():
    # a study named in the docs is one some scale defines (v4-full: scale v4-full), computed or exploratory
    scales = [load_scale(path.stem, SCALES) for path in SCALES.glob("*.yaml")]
    known = {name for scale in scales for name in (*studies(scale), *exploratory(scale))}
    for page in PAGES:
        for name in re.findall(r"\bstud(?:y|ies) `([\w-]+)`", text(page)):
            assert name in known, f"{page.relative_to(ROOT)} names study {name!r}"


def test_every_scale_named_exists():
    known = {p.stem for p in SCALES.glob("*.yaml")}
    for page in PAGES:
        body = text(page)
        named = set(re.findall(r"(?<![\w.])(?:scale|SCALE)=([\w-]+)", body))
        named |= set(re.findall(r"\bscale `([\w-]+)`", body))
        unknown = named - known - NOT_A_SCALE
        assert not unknown, f"{page.relative_to(ROOT)} names scales {sorted(unknown)}; known: {sorted(known)}"


def test_quoted_refusals_list_what_the_code_knows():
    errors = text(DOCS / "errors.md")
    scales = sorted(p.stem for p in SCALES.glob("*.yaml"))
    assert f"--config scale=huge: unknown scale; known: {', '.join(scales)}`" in errors
    claims_yaml = yaml.safe_load(text(ROOT / "preregistration" / "claims.yaml"))
    assert f"scale=huge: unknown; known: {', '.join(sorted(claims_yaml['scales']))}`" in errors
    assert f"unknown; known: {', '.join(map(str, sorted(VERSIONS)))}`" in errors


def test_every_prereg_version_mentioned_is_known():
    for page in PAGES:
        body = text(page)
        found = {int(n) for n in re.findall(r"prereg(?:_version)?[=: ]+(\d+)", body)}
        found |= {int(n) for n in re.findall(r"\b[Aa]mendment[- ](\d+)\b", body)}
        found |= {int(n) for n in re.findall(r"\b[Vv]ersions? (\d+)\b(?!\.\d)", body)}
        unknown = found - set(VERSIONS) - NOT_A_PREREG_VERSION
        assert not unknown, f"{page.relative_to(ROOT)} names pre-registration versions {sorted(unknown)}"


def make_targets():
    return set(re.findall(r"^([\w-]+):", text(ROOT / "Makefile"), flags=re.M))


def test_every_make_target_mentioned_exists():
    targets = make_targets()
    for page in PAGES:
        named = set(re.findall(r"`make ([\w-]+)", text(page)))
        named |= set(re.findall(r"^make ([\w-]+)", text(page), flags=re.M))  # code blocks
        # `make device-check` is being added to the Makefile with kvcert-device-check; until it lands, skip it.
        if "device-check" not in targets:
            named.discard("device-check")
        assert named <= targets, f"{page.relative_to(ROOT)} names make targets {sorted(named - targets)}"


def test_every_console_script_mentioned_exists():
    section = text(ROOT / "pyproject.toml").split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = set(re.findall(r"^([\w-]+)\s*=", section, flags=re.M))
    assert "kvcert-run" in scripts
    for page in PAGES:
        named = set(re.findall(r"\bkvcert-[a-z][a-z-]*[a-z]", text(page)))
        # kvcert-device-check is being added to pyproject.toml with the device check; until it lands, skip it.
        if "kvcert-device-check" not in scripts:
            named.discard("kvcert-device-check")
        named -= NOT_A_SCRIPT
        assert named <= scripts, f"{page.relative_to(ROOT)} names console scripts {sorted(named - scripts)}"


def test_glossary_gives_the_codes_default_level():
    from kvcert.calibration import default_level

    assert default_level(0.05) == pytest.approx(0.99)
    glossary = text(DOCS / "GLOSSARY.md")
    delta = "<!-- value:yaml file=preregistration/claims.yaml conventions.delta g -->0.05<!-- /value -->"
    assert f"default 1 − δ/5, at the pre-registered δ = {delta}" in glossary
    assert "level 1 − δ/5" in text(DOCS / "calibration.md")


# --- times: one source --------------------------------------------------------------------------------------


def readme_times():
    """README's command table: (command, study, its cells' time from their manifests)."""
    for header, body in markdown_tables(README):
        if header[:3] == ["command", "study", "cells' time, two cells at a time"]:
            return [(r[0], r[1], r[2]) for r in body]
    raise AssertionError("README lost its table of commands and times")


def test_readme_times_are_the_study_pages_times():
    listed = readme_times()
    assert {study for _, study, _ in listed} >= set(studies(load_scale("default", SCALES)))
    for command, study, time in listed:
        # the column is the study's cells' time, as rule render_docs reads it from their manifests
        assert time.startswith(f"<!-- value:cells study={study} minutes_on_2_cores "), (command, time)
        page = text(STUDY_DOCS / f"{study}.md")
        assert f"**{time}**" in page, f"README gives {command} {time!r}, docs/studies/{study}.md does not"
        assert command in page, f"docs/studies/{study}.md does not name {command}"


# --- figures quoted from results/ ---------------------------------------------------------------------------


def pooled_accuracy(study, keys):
    """accuracy.csv of a study pooled over tasks (weighted by n), per the given key columns."""
    total = defaultdict(lambda: [0.0, 0])
    for r in rows(RESULTS / "accuracy.csv"):
        if r["study"] == study:
            key = tuple(float(r[k]) if k == "budget" else r[k] for k in keys)
            total[key][0] += float(r["accuracy"]) * int(r["n"])
            total[key][1] += int(r["n"])
    return {k: (s / n, n) for k, (s, n) in total.items()}


def test_accuracy_tables_of_the_study_pages_are_accuracy_csv():
    checked = 0
    for page in STUDY_DOCS.glob("*.md"):
        for header, body in markdown_tables(page):
            if not {"setting", "policy", "design", "budget", "accuracy", "n"} <= set(header):
                continue
            keys = [k for k in ("model", "setting", "policy", "design", "budget") if k in header]
            pooled = pooled_accuracy(page.stem, keys)
            for cells in body:
                row = dict(zip(header, cells))
                key = tuple(float(row[k]) if k == "budget" else row[k] for k in keys)
                accuracy, n = pooled[key]
                assert same_shown(accuracy, float(row["accuracy"]), 1) and int(row["n"]) == n, (page.name, row)
                checked += 1
    assert checked >= 30


def test_reproduction_table_is_reproduction_csv():
    table = {(r["study"], r["quantity"]): r for r in rows(RESULTS / "reproduction.csv")}
    fmt = lambda x: f"{float(x):.4g}"  # noqa: E731  (the grid's 4 significant digits)
    checked = 0
    for page in STUDY_DOCS.glob("*.md"):
        for header, body in markdown_tables(page):
            if header[:3] != ["quantity", "paper", "ours [CI]"]:
                continue
            for quantity, paper, ours, note in body:
                r = table[(page.stem, quantity)]
                assert paper == r["paper"] and note == r["note"]
                assert ours == f"{fmt(r['ours'])} [{fmt(r['ci_low'])}, {fmt(r['ci_high'])}]", quantity
                checked += 1
    assert checked == len([k for k in table if k[0] == "v1"])


def test_calibration_study_table_is_the_benchmarks_output():
    page_rows = [c for header, body in markdown_tables(DOCS / "calibration.md")
                 if header[:4] == ["model", "setting", "π", "certificate"] for c in body]
    written = [c for header, body in markdown_tables(RESULTS / "calibration" / "tradeoff.md") for c in body]
    assert page_rows == written and len(written) == 40


def test_sensitivity_table_is_sensitivity_csv():
    table = {(r["knob"], r["value"], float(r["budget"])): r for r in rows(RESULTS / "sensitivity" / "sensitivity.csv")}
    checked = 0
    for header, body in markdown_tables(STUDY_DOCS / "sensitivity.md"):
        if header[:3] != ["knob", "value", "budget"]:
            continue
        for cells in body:
            r = table[(cells[0], cells[1], float(cells[2]))]
            assert cells[3:6] == [f"{float(r[c]):.1f}" for c in ("acc_full", "acc_topk", "acc_poisson")], cells
            for cell, name in ((cells[6], "topk_minus_full"), (cells[7], "poisson_minus_topk")):
                assert cell == (f"{float(r[name]):.1f} [{float(r[name + '_lo']):.1f}, "
                                f"{float(r[name + '_hi']):.1f}]"), cells
            assert cells[8] == f"{float(r['coverage']):.3f}"
            assert cells[9] == f"{int(r['worst_layer'])}: {float(r['worst_layer_coverage']):.3f}"
            checked += 1
    assert checked == len(table)


def test_readme_states_verify_results_tolerance():
    module = workflow_script("compare_results")
    # README renders both from the script's constants (source const), so that an edit of one moves the other
    readme = " ".join(text(README).split())
    stated = re.search(r"every other number within <!-- value:const file=workflow/scripts/compare_results.py RTOL "
                       r"\.0e -->([^<]+)<!-- /value --> relative or <!-- value:const "
                       r"file=workflow/scripts/compare_results.py WIDTH_FRACTION \.0% -->(\d+)%<!-- /value -->", readme)
    assert stated and float(stated.group(1).replace("−", "-")) == module.RTOL
    assert float(stated.group(2)) / 100 == module.WIDTH_FRACTION


def test_errors_page_lists_every_refusal_of_kvcert_calibrate():
    """docs/errors.md's kvcert-calibrate table has a row for each case of tests/test_calibration_cli.py ({d},
    {file} as the table writes them)."""
    cases = load_module(ROOT / "tests" / "test_calibration_cli.py", "calibration_cli_cases")
    errors = text(DOCS / "errors.md")
    section = errors[errors.index("#### `kvcert-calibrate`"):]
    section = section[: section.index("\n#### ", 10)]
    for case in cases.CALIBRATE_CASES:
        assert case[2].format(d="<dir>") in section, case[0]
    for case in cases.RUN_CASES:
        assert case[3].format(d="<dir>", file="<file>") in section, case[0]


def test_paper_scale_plan_is_kvcert_plans_output(scale_dag, monkeypatch):
    """docs/cluster.md shows `kvcert-plan scale=paper` as the code prints it, and its prose says of that output what
    holds: which cells are the largest and why, the GPU-hours against the paper's, the runtime against the longest
    shard."""
    from kvcert import plan as plan_module
    from kvcert.plan import PAPER_GPU_HOURS, plan_scale, render

    # the jobs from the session's dry run of the paper scale (tests/conftest.py's scale_dag: kvcert.plan.plan_jobs,
    # built once for every test that reads that DAG)
    monkeypatch.setattr(plan_module, "plan_jobs", lambda name, root: scale_dag(name))
    page = text(DOCS / "cluster.md")
    shown = page.split("$ kvcert-plan scale=paper\n", 1)[1].split("```", 1)[0]
    printed = render(plan_scale("paper", ROOT)) + "\n"

    def jobs(block):  # the jobs per rule, in whatever order the plan lists them
        line = next(line for line in block.splitlines() if line.startswith("jobs per rule: "))
        return dict(re.findall(r"(\w+) (\d+)", line)), [l for l in block.splitlines() if l != line]

    assert jobs(shown) == jobs(printed), \
        "docs/cluster.md's kvcert-plan output is stale: paste `kvcert-plan scale=paper` again"

    def hours(block):  # per device: (longest shard job in hours, GPU-hours)
        return {d: (float(h), int(g)) for d, h, g in re.findall(r"^(\S+)\s+[\d.]+\s+([\d.]+)\s+(\d+)$", block, flags=re.M)}

    prose = " ".join(page.split())
    # above the paper's GPU-hours at the assumed host overhead (below them with a faster host: the next test)
    assert "sits above the paper's about" in prose
    assert min(g for _, g in hours(printed).values()) > PAPER_GPU_HOURS
    # a cell's runtime is the longest shard on the slowest card listed, with a margin
    runtime = load_scale("paper", SCALES)["resources"]["cell"]["runtime"]
    assert "minutes, the longest shard on an A100-40GB with a margin" in prose
    longest = hours(printed)
    assert max(h for h, _ in longest.values()) == longest["A100-40GB"][0] and longest["A100-40GB"][0] * 60 < runtime
    every = {line.split()[0]: line.split() for line in printed.splitlines() if re.match(r"^\S+/\S+\s+\d+\s", line)}
    cells = {name.split("/")[-1]: fields for name, fields in every.items() if name.startswith("paper/")}
    board = {name.split("/")[-1]: fields for name, fields in every.items() if name.startswith("leaderboard/")}
    expanded = studies(load_scale("paper", SCALES))["paper"]["cells"]  # the matrix and its variants
    assert set(cells) == set(expanded) and len(board) == 4 and len(every) == len(cells) + len(board)
    header = next(line.split() for line in printed.splitlines() if line.startswith("cell "))
    assert header[-3] == "40GB" and all(fields[-3] == "yes" for fields in every.values()), \
        "a cell no longer fits the smallest card: say which"
    assert "Every cell fits the smallest card by the cost model (column `40GB`)" in prose
    largest = sorted(cells, key=lambda name: float(cells[name][-4]), reverse=True)[:2]
    assert sorted(largest) == ["llama8b-longbench16k-streaming", "mistral7b-longbench16k-streaming"]
    assert "the largest, the 16k-token streaming cells of Llama and Mistral" in prose
    # weights, batch cache and oracle copy make most of their total
    assert all(sum(map(float, (cells[c][2], cells[c][4], cells[c][6]))) > float(cells[c][-4]) / 2 for c in largest)
    # the leaderboard's largest owes its lead to its compressed batch (column `batch cache`)
    board_largest = max(board, key=lambda name: float(board[name][-4]))
    assert board_largest == max(board, key=lambda name: float(board[name][4]))
    assert f"the leaderboard's largest, {board_largest}, owes its lead to the compressed batch" in prose


@pytest.mark.slow  # a second costing of every cell of the paper scale: 4-9 s
def test_paper_scale_plan_falls_below_the_papers_gpu_hours_with_a_faster_host(monkeypatch):
    """docs/cluster.md: with `--host-overhead-ms 0.5` the paper scale's GPU-hours on H100s and H200s fall below the
    paper's (the figures are history.md's). The jobs play no part in the hours: no dry run."""
    from kvcert import plan as plan_module
    from kvcert.plan import PAPER_GPU_HOURS, as_json, plan_scale

    prose = " ".join(text(DOCS / "cluster.md").split())
    assert "with a faster host (`--host-overhead-ms 0.5`) it falls below it" in prose
    monkeypatch.setattr(plan_module, "plan_jobs", lambda name, root: {})
    hours = as_json(plan_scale("paper", ROOT, overhead=0.5e-3))["gpu_hours"]
    assert 0 < max(hours["H100-80GB"], hours["H200-141GB"]) < PAPER_GPU_HOURS


def test_every_kvcert_name_in_the_docs_exists():
    import importlib

    for page in (README, DOCS / "library.md", DOCS / "pipeline.md"):
        for dotted in sorted(set(re.findall(r"\bkvcert(?:\.[A-Za-z_]\w*)+", text(page)))):
            parts = dotted.split(".")
            for depth in range(len(parts), 0, -1):  # the longest importable module, then attributes
                try:
                    obj = importlib.import_module(".".join(parts[:depth]))
                    break
                except ImportError:
                    continue
            for attr in parts[depth:]:
                assert hasattr(obj, attr), f"{page.relative_to(ROOT)} names {dotted}"
                obj = getattr(obj, attr)
    # The library section's table lists names `kvcert` exports.
    import kvcert

    for header, body in markdown_tables(DOCS / "library.md"):
        if header[:2] == ["name", "what it is"]:
            for cells in body:
                for name in re.findall(r"`(\w+)", cells[0]):
                    assert hasattr(kvcert, name) or name == "kvcert", name


def _top_level_split(cell):
    """Split a defaults cell on the commas outside brackets and braces."""
    parts, depth, current = [], 0, ""
    for char in cell:
        depth += (char in "[{") - (char in "]}")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p.strip().strip("`").strip() for p in [*parts, current]]


def test_kvcert_run_key_table_is_the_schema():
    """docs/library.md's kvcert-run table lists every key of kvcert.run_schema.RunConfig with its default."""
    import dataclasses

    from omegaconf import MISSING

    from kvcert.run_schema import RUN

    table = next(body for header, body in markdown_tables(DOCS / "library.md") if header[:2] == ["key", "default"])
    documented = {}
    for cells in table:
        keys = re.findall(r"`(\w+)`", cells[0])
        shown = re.sub(r"<!-- (?:value:[^>]*|/value) -->", "", cells[1])  # a rendered default: its text
        values = _top_level_split(shown) if len(keys) > 1 else [shown.strip("`")]
        assert len(values) == len(keys), cells
        documented.update(zip(keys, values))
    fields = [f.name for f in dataclasses.fields(RUN) if f.name != "defaults"]
    assert sorted(documented) == sorted(fields)
    groups = {next(iter(d)): d[next(iter(d))] for d in RUN.defaults if isinstance(d, dict)}
    for key, shown in documented.items():
        value = getattr(RUN, key)
        if key in groups:
            assert shown == groups[key], key
        elif dataclasses.is_dataclass(value):
            assert yaml.safe_load("{" + shown + "}") == dataclasses.asdict(value), key
        elif value == MISSING:
            assert shown == "required", key
        else:
            assert yaml.safe_load(shown) == value, (key, shown, value)


def test_device_check_section_names_the_paper_scales_dtype():
    page = text(DOCS / "cluster.md")
    assert any(part.startswith("First command on a GPU node") for part in page.split("\n## ")[1:])
    dtypes = {o.split("=", 1)[1] for overrides in load_scale("paper", SCALES)["models"].values()
              for o in overrides if str(o).startswith("model.dtype=")}
    assert len(dtypes) == 1 and f"in the paper scale's dtype ({dtypes.pop()})" in " ".join(page.split())


def test_held_out_check_table_is_the_third_confirmations():
    """docs/calibration.md's held-out check on Gemma 3 reads results/calibration/confirmation/third-confirmation.md."""
    record = {}
    for header, body in markdown_tables(RESULTS / "calibration" / "confirmation" / "third-confirmation.md"):
        if "cov_cal" in header:
            record.update({(r["policy"], float(r["budget"])): r for r in (dict(zip(header, c)) for c in body)})
    table = next(body for header, body in markdown_tables(DOCS / "calibration.md")
                 if header[:2] == ["π (policy)", "budget"])
    assert len(table) == len(record) == 8
    for pi, budget, paper, calibrated, width, rho in table:
        r = record[(pi, float(budget))]
        for shown, columns in ((paper, ("cov", "worst", "below94")),
                               (calibrated, ("cov_cal", "worst_cal", "below94_cal"))):
            for part, column in zip(shown.split(", "), columns, strict=True):
                decimals = len(part.split(".")[1]) if "." in part else 0
                assert same_shown(r[column], float(part), decimals), (pi, budget, column, part)
        assert width == "inf" if r["width"] == "inf" else same_shown(r["width"], float(width), 2), width
        for part, column in zip(rho.split(" / "), ("rho", "rho_cal"), strict=True):
            assert same_shown(r[column], float(part), 2), (pi, budget, column)


def test_task_probe_table_is_the_probes_output():
    names = {"smollm2": "smollm2", "gemma3": "gemma3"}  # the page renders the table's own model names
    probes = {(r["model"], r["task"]): r for m in names.values() for r in rows(RESULTS / "probes" / f"{m}.csv")}
    shown = [cells for header, body in markdown_tables(STUDY_DOCS / "v4.md")
             if header == ["model", "task", "correct", "of", "accuracy"] for cells in body]
    assert len(shown) == len(probes) == 8
    for model, task, correct, of, accuracy in shown:
        r = probes[(names[model], task)]
        assert [correct, of] == [r["n_correct"], r["n_items"]] and float(accuracy) == float(r["accuracy"])
        assert int(r["seed"]) == 9501  # the seed the page says is spent

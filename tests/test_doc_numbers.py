"""Hand-written numbers in README.md and docs/: every number a page states is a rendered span (a committed table,
a locked YAML key, a code constant; workflow/scripts/render_docs.py) or one of the renderer's DEFINITIONS (a
version, a step of a numbered list, a name such as Gemma 3, code a reader types, a citation's year). The count
outside those is held per page: a page listed in HAND_WRITTEN may state exactly that many numbers by hand (the
ones it still carries, shown by `make doc-numbers V=1`), every other page none. The count may only fall: a page
that loses hand-written numbers must lower its entry. docs/history.md is the dated diary (what was measured
when): its numbers are records of a date, not statements about the code or the results now, and are not counted.
Pure text, no model: a second or two."""

import re
from pathlib import Path

import pytest

from helpers.scripts import render_docs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
HISTORY = ROOT / "docs" / "history.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "studies").glob("*.md"))]
COUNTED = [p for p in PAGES if p != HISTORY]
# The pages that still state numbers by hand, with how many (make doc-numbers); every other page states none.
HAND_WRITTEN = {
}


renderer = render_docs  # one module: its table caches serve every page


def name(page):
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", COUNTED, ids=[name(p) for p in COUNTED])
def test_page_states_no_more_numbers_by_hand_than_its_count(page):
    found = renderer().hand_written(page.read_text(encoding="utf-8"))
    allowed = HAND_WRITTEN.get(name(page), 0)
    shown = " | ".join(f"{line}: {number} ({context})" for line, number, context in found[:12])
    assert len(found) <= allowed, (f"{name(page)} states {len(found)} numbers by hand, {allowed} allowed: render "
                                   f"them (workflow/scripts/render_docs.py) or drop them; {shown}")
    assert len(found) == allowed, (f"{name(page)} states {len(found)} numbers by hand, fewer than its count "
                                   f"{allowed}: lower HAND_WRITTEN[{name(page)!r}] in tests/test_doc_numbers.py")


def test_the_count_lists_only_pages_that_exist():
    assert set(HAND_WRITTEN) <= {name(p) for p in COUNTED}
    assert all(count > 0 for count in HAND_WRITTEN.values())


TOP_LEVEL = sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", TOP_LEVEL, ids=[name(p) for p in TOP_LEVEL])
def test_page_is_its_rendering(page):
    """docs/*.md, rendered by make render-docs (README.md and docs/studies/, which rule render_docs renders too,
    are checked by tests/test_docs.py)."""
    body = page.read_text(encoding="utf-8")
    assert renderer().render(body, RESULTS, where=name(page)) == body, f"{name(page)} is stale: make render-docs"


def test_what_counts_as_hand_written():
    text = ("Amendment 4 and amendments 2 and\n  [3](x.md) keep version 1's 0.95 (C3, v5, H200).\n"
            "1. a step; §7 of Gemma 3 and Llama 3.1 (P. Xie, 2026), a (1 − δ) bound, `budget=0.25`\n"
            "```\nmake x N=12\n```\n"
            "it took 138 minutes, <!-- value:claims study=v1 claim=c1 estimate .1f -->−50.0<!-- /value --> points;\n"
            "<!-- rows:claims study=v1\n| claim | at 95% |\n| {claim} | {estimate:.1f} |\n-->\n| claim | at 95% |\n"
            "| c1 | −50.0 |\n<!-- /rows -->\nand 1,200 items at 25%, −3.5 lower, 2- and 4-needle\n"
            "π = 1 on (0, 1], 1 − π (Feng et al. 2024); it exits 2; within 1e-5 of 64 values\n"
            "check 2 wrote results/heldout-2/check.csv, 8/15 right on 2026-12-01 (runbook, steps 2-4)\n")
    found = renderer().hand_written(text)
    # a rows span's template counts once (its header's 95), its rendered lines not at all
    assert [number for _, number, _ in found] == ["0.95", "138", "95", "1,200", "25", "−3.5", "2", "4", "1e-5", "64",
                                                  "8", "15"]
    assert [line for line, _, _ in found] == [2, 7, 9, 15, 15, 15, 15, 15, 16, 16, 17, 17]


def test_rows_span_renders_a_tables_body(tmp_path):
    (tmp_path / "t.csv").write_text("model,budget,acc\nb,0.5,61.25\na,0.25,-3\na,0.5,70\n")
    key = "<!-- rows:table file=t.csv model=a sort=budget\n| model | budget | acc |\n|---|---|---|\n" \
          "| {model} | {budget:g} | {acc:.1f} |\n-->\n"
    page = f"x\n{key}old\n<!-- /rows -->\n"
    out = renderer().render(page, tmp_path)
    # the header (the template's lines before its first field) once, then a line per row, sorted by budget
    assert out == (f"x\n{key}| model | budget | acc |\n|---|---|---|\n"
                   "| a | 0.25 | -3.0 |\n| a | 0.5 | 70.0 |\n<!-- /rows -->\n")
    assert renderer().render(out, tmp_path) == out
    with pytest.raises(ValueError, match=r"rows key 'table file=t.csv model=z': no rows match"):
        renderer().render(page.replace("model=a sort=budget", "model=z"), tmp_path)
    with pytest.raises(ValueError, match=r"template field 'nosuch'"):
        renderer().render(page.replace("{acc:.1f}", "{nosuch}"), tmp_path)


def test_rows_span_pools_accuracy_by_the_columns_it_names():
    """``by=`` pools accuracy.csv over the columns it leaves out (weighted by n), as the value source does."""
    page = ("<!-- rows:accuracy study=v1 setting=streaming policy=full by=setting,policy\n"
            "{setting} {policy} {accuracy:.4f} {n}\n-->\n<!-- /rows -->")
    out = renderer().render(page, RESULTS)
    one = renderer().value(RESULTS, "accuracy study=v1 setting=streaming policy=full accuracy .4f")
    n = renderer().value(RESULTS, "accuracy study=v1 setting=streaming policy=full n d")
    assert f"-->\nstreaming full {one} {n}\n<!-- /rows -->" in out


def test_a_field_written_not_equal_leaves_its_rows_out_and_a_constants_item_is_read_by_position(tmp_path):
    """``FIELD!=VALUE`` keeps the rows whose FIELD differs (a width range over its finite cells, as
    docs/CALIBRATION-LEVEL.md renders it), in a value and in a rows span; ``FIELD~=REGEX`` the rows whose whole FIELD
    it matches; ``const ... NAME.N`` is a tuple's Nth item."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "t.csv").write_text("policy,budget,width\nsnapkv,0.1,1.15\nsnapkv,0.5,1.01\nsnapkv,0.75,inf\n"
                                   "uniform,0.1,1.9\n")
    value = renderer().value
    assert value(results, "table file=t.csv policy=snapkv max(width) .2f") == "inf"
    assert value(results, "table file=t.csv policy=snapkv width!=inf max(width) .2f") == "1.15"
    assert value(results, "table file=t.csv policy!=snapkv max(width) .2f") == "1.90"
    assert value(results, "table file=t.csv policy~=snap.* width!=inf min(width) .2f") == "1.01"
    with pytest.raises(ValueError, match=r"0 rows match"):  # the whole cell must match, not a part of it
        value(results, "table file=t.csv policy~=snap budget=0.1 width .2f")
    with pytest.raises(ValueError, match=r"not a regular expression"):
        value(results, "table file=t.csv policy~=( width .2f")
    page = "<!-- rows:table file=t.csv width!=inf policy=snapkv\n{budget:g}\n-->\n<!-- /rows -->"
    assert renderer().render(page, results).endswith("-->\n0.1\n0.5\n<!-- /rows -->")
    (tmp_path / "m.py").write_text("LEVELS = (0.9, 0.95, 0.975, 0.99)\n")
    assert [value(results, f"const file=m.py LEVELS.{i} g") for i in (0, 3)] == ["0.9", "0.99"]
    assert value(results, "const file=m.py LEVELS g") == "0.9, 0.95, 0.975, 0.99"
    with pytest.raises(ValueError, match=r"no column 'LEVELS.4'"):
        value(results, "const file=m.py LEVELS.4 g")
    # the repository's own: the grid the default calibration level was chosen from
    assert value(RESULTS, "const file=benchmarks/calibration_study.py LEVELS.3 g") == "0.99"


def test_const_and_yaml_sources_read_the_files_themselves(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "m.py").write_text("import os\nRTOL, ATOL = 1e-5, 1e-9\nLEVEL: float = 0.99\nPATH = os.sep\n")
    (tmp_path / "d.yaml").write_text("claims:\n  - id: c3\n    budgets: [0.25, 0.5]\n")
    render = renderer().render
    assert render("<!-- value:const file=m.py ATOL .0e -->x<!-- /value -->", results).endswith("-->1e−9<!-- /value -->")
    assert render("<!-- value:const file=m.py LEVEL .0% -->x<!-- /value -->", results).endswith("-->99%<!-- /value -->")
    assert render("<!-- value:yaml file=d.yaml claims.c3.budgets.1 .0% -->x<!-- /value -->", results).endswith(
        "-->50%<!-- /value -->")
    with pytest.raises(ValueError, match=r"no column 'PATH'"):  # not a literal: not a constant the page may state
        render("<!-- value:const file=m.py PATH s -->x<!-- /value -->", results)
    with pytest.raises(ValueError, match=r"const: no such Python file 'n.py'"):
        render("<!-- value:const file=n.py RTOL g -->x<!-- /value -->", results)


def test_const_source_reads_a_dataclass_fields_default_given_by_a_call(tmp_path):
    """A class's field whose default a call gives (the run schema's ``knob(20, "help")``, ``field(default=...)``)
    is read as that default; a call without a literal default, or one outside a class, is no constant."""
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "m.py").write_text(
        "from dataclasses import dataclass, field\n"
        "def knob(default, help): return field(default=default)\n"
        "TOP = knob(3, 'a call outside a class')\n"
        "@dataclass\nclass Run:\n"
        "    n_items: int = knob(20, 'items')\n    delta: float = field(default=0.05, metadata={})\n"
        "    grids: list = field(default_factory=list)\n    plain: int = 16\n")
    value = renderer().value
    assert [value(results, f"const file=m.py {key}") for key in ("Run.n_items d", "Run.delta g", "Run.plain d")] \
        == ["20", "0.05", "16"]
    for name in ("Run.grids", "TOP"):
        with pytest.raises(ValueError, match=f"no column '{name}'"):
            value(results, f"const file=m.py {name} g")
    # the repository's own schema: what docs/library.md renders as kvcert-run's defaults
    from kvcert.run_schema import RUN

    assert renderer().value(RESULTS, "const file=src/kvcert/run_schema.py RunConfig.n_items d") == str(RUN.n_items)
    assert renderer().value(RESULTS, "const file=src/kvcert/run_schema.py DesignOptions.head_fraction g") == \
        format(RUN.design_options.head_fraction, "g")


def test_make_targets_render_and_count_every_page():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^render-docs:\n\t.*render_docs\.py results --grid results/claims_grid\.md \$\(DOC_PAGES\)",
                     makefile, flags=re.M)
    assert re.search(r"^doc-numbers:\n\t.*render_docs\.py results --count", makefile, flags=re.M)
    assert "DOC_PAGES := README.md $(sort $(wildcard docs/*.md)) $(sort $(wildcard docs/studies/*.md))" in makefile


def test_rows_span_shows_an_undefined_cell_as_a_dash(tmp_path):
    """An empty cell under a numeric format is undefined (a full cache has no error): shown as one dash, and a
    range of two such cells as one dash too; a column named with a dot is also reachable with an underscore."""
    (tmp_path / "t.csv").write_text("configuration,err,low_0.1,high_0.1\nfull,,,\ntarget,0.0167,0.935,0.953\n")
    page = ("<!-- rows:table file=t.csv\n| {configuration} | {err:.3f} | {low_0_1:.2f}–{high_0_1:.2f} |\n-->\n"
            "<!-- /rows -->")
    out = renderer().render(page, tmp_path)
    assert out.endswith("-->\n| full | — | — |\n| target | 0.017 | 0.94–0.95 |\n<!-- /rows -->")

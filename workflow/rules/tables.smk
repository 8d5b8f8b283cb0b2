# Stage 4: paper tables over every study of the scale: the claims table (csv, markdown, LaTeX; one row per
# study and claim, with its pre-registration version), the reproduction table, accuracy per task and the
# claims of each model alone (studies with several models).

TABLES = [f"{OUT}/{name}" for name in ("claims.csv", "claims.md", "claims.tex", "reproduction.csv", "accuracy.csv",
                                     "claims_by_model.csv", "claims_by_policy.csv")]
STUDY_ACCURACY = [f"{study_dir(study)}/accuracy.csv" for study in STUDIES]


rule accuracy:
    input:
        item_tables=lambda wc: [f"{d}/items.parquet" for d in cell_dirs(wc.study)],
    output:
        f"{OUT}/{{study}}/accuracy.csv",
    log:
        f"{OUT}/logs/accuracy-{{study}}.log",
    wildcard_constraints:
        study="|".join(COMPUTED) or "no-study",
    params:
        analysis=ANALYSIS_FINGERPRINT,
        cells=lambda wc: cell_dirs(wc.study),
    shell:
        "kvcert-accuracy {params.cells} --out {output} > {log} 2>&1"


rule aggregate:
    input:
        claims=CLAIM_JSON,
        accuracy=STUDY_ACCURACY,
    output:
        csv=report(f"{OUT}/claims.csv", category="Tables", caption="../report/claims_table.rst"),
        md=f"{OUT}/claims.md",
        tex=f"{OUT}/claims.tex",
        reproduction=report(f"{OUT}/reproduction.csv", category="Tables", caption="../report/reproduction.rst"),
        accuracy=f"{OUT}/accuracy.csv",
        by_model=f"{OUT}/claims_by_model.csv",
        by_policy=f"{OUT}/claims_by_policy.csv",
    log:
        f"{OUT}/logs/aggregate.log",
    params:
        analysis=ANALYSIS_FINGERPRINT,
    shell:
        "kvcert-aggregate {input.claims} --accuracy {input.accuracy} --out-dir {OUT} > {log} 2>&1"


# The numbers of README.md and docs/studies/*.md: every value span and generated block (the results grid among
# them) rendered in place from the tables it names (workflow/scripts/render_docs.py), so that no number in them
# is typed by hand; tests/test_docs.py fails when a page differs from its rendering. The pages are rendered only
# for the committed results (their inputs: the pages and every table their values read); any other outdir gets
# the grid alone. The only rule that writes those pages.
DOC_PAGES = [str(REPO / "README.md"), *sorted(str(p) for p in (REPO / "docs" / "studies").glob("*.md"))]
RENDERS_DOCS = Path(OUT).resolve() == (REPO / "results").resolve()


def render_docs_inputs(wildcards):
    if not RENDERS_DOCS:
        return [f"{OUT}/claims.csv"]
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_docs", REPO / "workflow" / "scripts" / "render_docs.py")
    renderer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(renderer)
    return [*DOC_PAGES, *renderer.inputs(DOC_PAGES, OUT)]


rule render_docs:
    input:
        render_docs_inputs,
    output:
        grid=f"{OUT}/claims_grid.md",
    params:
        results=OUT,
        pages=DOC_PAGES if RENDERS_DOCS else [],
    localrule: True
    script:
        "../scripts/render_docs.py"

# Stage 4: paper tables over every study of the scale: the claims table (csv, markdown, LaTeX; one row per
# study and claim, with its pre-registration version), the reproduction table, accuracy per task and the
# claims of each model alone (studies with several models).

TABLES = [f"{OUT}/{name}" for name in ("claims.csv", "claims.md", "claims.tex", "reproduction.csv", "accuracy.csv",
                                     "claims_by_model.csv")]
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
    log:
        f"{OUT}/logs/aggregate.log",
    params:
        analysis=ANALYSIS_FINGERPRINT,
    shell:
        "kvcert-aggregate {input.claims} --accuracy {input.accuracy} --out-dir {OUT} > {log} 2>&1"


# README's results grid: every study's seven verdicts beside the paper's, from the claims table. For the
# committed results it also replaces the grid between README.md's results-grid markers, so the grid is never
# typed by hand (tests/test_docs.py compares the two). Not part of `all`, whose jobs kvcert-plan lists
# (kvcert.plan.plan_jobs): snakemake --cores 1 results/claims_grid.md
rule readme_grid:
    input:
        claims=f"{OUT}/claims.csv",
    output:
        grid=f"{OUT}/claims_grid.md",
    params:
        readme=str(REPO / "README.md") if Path(OUT).resolve() == (REPO / "results").resolve() else "",
    localrule: True
    script:
        "../scripts/readme_grid.py"

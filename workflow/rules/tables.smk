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
        "python -m kvcert.analysis.accuracy {params.cells} --out {output} > {log} 2>&1"


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
        "python -m kvcert.analysis.aggregate {input.claims} --accuracy {input.accuracy} --out-dir {OUT} > {log} 2>&1"

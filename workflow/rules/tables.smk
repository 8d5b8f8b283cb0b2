# Stage 4: paper tables: the claims table (csv, markdown, LaTeX), the reproduction table and the claims
# of each model alone (scales with several models).

TABLES = [f"{OUT}/{name}" for name in ("claims.csv", "claims.md", "claims.tex", "reproduction.csv", "claims_by_model.csv")]


rule aggregate:
    input:
        CLAIM_JSON,
    output:
        csv=report(f"{OUT}/claims.csv", category="Tables", caption="../report/claims_table.rst"),
        md=f"{OUT}/claims.md",
        tex=f"{OUT}/claims.tex",
        reproduction=report(f"{OUT}/reproduction.csv", category="Tables", caption="../report/reproduction.rst"),
        by_model=f"{OUT}/claims_by_model.csv",
    log:
        f"{OUT}/logs/aggregate.log",
    shell:
        "python -m kvcert.analysis.aggregate {input} --out-dir {OUT} > {log} 2>&1"

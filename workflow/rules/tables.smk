# Stage 4: paper tables: the claims table (csv, markdown, LaTeX) and the reproduction table.

TABLES = [f"{OUT}/{name}" for name in ("claims.csv", "claims.md", "claims.tex", "reproduction.csv")]


rule aggregate:
    input:
        CLAIM_JSON,
    output:
        csv=report(f"{OUT}/claims.csv", category="Tables", caption="../report/claims_table.rst"),
        md=f"{OUT}/claims.md",
        tex=f"{OUT}/claims.tex",
        reproduction=report(f"{OUT}/reproduction.csv", category="Tables", caption="../report/reproduction.rst"),
    log:
        f"{OUT}/logs/aggregate.log",
    params:
        analysis=ANALYSIS_FINGERPRINT,
    shell:
        "python -m kvcert.analysis.aggregate {input} --out-dir {OUT} > {log} 2>&1"

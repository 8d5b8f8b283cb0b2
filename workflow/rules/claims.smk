# Stage 3: the seven pre-registered claims. Each claim job verifies the pre-registration lock first
# (kvcert-claim refuses on any edit), reads every cell of the scale and filters its own population.

CLAIM_JSON = expand(f"{OUT}/claims/{{claim}}.json", claim=CLAIMS)
CLAIM_FIGURES = expand(f"{FIG}/{{claim}}.{{ext}}", claim=CLAIMS, ext=["png", "pdf"])


# A hash check of a few files: not worth a cluster job.
localrules:
    verify_preregistration,


rule verify_preregistration:
    input:
        f"{REPO}/preregistration/claims.yaml",
        f"{REPO}/preregistration/prereg.lock",
    output:
        f"{OUT}/logs/preregistration.verified",
    shell:
        "kvcert-prereg --root {REPO} verify > {output}.tmp && mv {output}.tmp {output}"


rule claim:
    input:
        verified=f"{OUT}/logs/preregistration.verified",
        item_tables=CELL_ITEMS,
        step_tables=CELL_STEPS,
    output:
        json=f"{OUT}/claims/{{claim}}.json",
        png=report(f"{FIG}/{{claim}}.png", category="Claims", caption="../report/claim.rst"),
        pdf=f"{FIG}/{{claim}}.pdf",
    log:
        f"{OUT}/logs/claims/{{claim}}.log",
    params:
        cells=",".join(CELL_DIRS),
    resources:
        mem_mb=resource("claim", "mem_mb", 4000),
        runtime=resource("claim", "runtime", 20),
    shell:
        "kvcert-claim claim={wildcards.claim} 'cells=[{params.cells}]' out={output.json} "
        "figure_dir={FIG} scale={CLAIM_SCALE} prereg_root={REPO} > {log} 2>&1"

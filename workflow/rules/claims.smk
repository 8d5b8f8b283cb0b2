# Stage 3: the seven pre-registered claims. Each claim job verifies the pre-registration lock first
# (kvcert-claim refuses on any edit), reads every cell of the scale and filters its own population.

# Every file a lock freezes (pre-registration files and the frozen analysis code): an edit reruns the
# verification, which then fails (kvcert-prereg refuses a changed file).
from kvcert.analysis.prereg import frozen_files

FROZEN_INPUTS = [f"{REPO}/{rel}" for rel in frozen_files(REPO)]
CLAIM_JSON = expand(f"{OUT}/claims/{{claim}}.json", claim=CLAIMS)
CLAIM_FIGURES = expand(f"{FIG}/{{claim}}.{{ext}}", claim=CLAIMS, ext=["png", "pdf"])


rule verify_preregistration:
    input:
        FROZEN_INPUTS,
    output:
        f"{OUT}/logs/preregistration.verified",
    params:
        analysis=ANALYSIS_FINGERPRINT,
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
        analysis=ANALYSIS_FINGERPRINT,  # reruns the claim when the analysis code or pre-registration changes
        cells=",".join(CELL_DIRS),
    resources:
        mem_mb=resource("claim", "mem_mb", 4000),
        runtime=resource("claim", "runtime", 20),
    shell:
        "kvcert-claim claim={wildcards.claim} 'cells=[{params.cells}]' out={output.json} "
        "figure_dir={FIG} scale={SCALE_NAME} prereg_root={REPO} > {log} 2>&1"

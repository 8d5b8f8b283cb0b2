# Stage 3: the seven pre-registered claims, per study. Each claim job verifies the locks of its
# pre-registration version first (kvcert-claim refuses on any edit), reads every cell of the study and
# filters its own population with that version's frozen analysis code.

CLAIM_JSON = [f"{study_dir(study)}/claims/{claim}.json" for study in STUDIES for claim in CLAIMS]
CLAIM_FIGURES = [f"{FIG}/{study}/{claim}.{ext}" for study in COMPUTED for claim in CLAIMS for ext in ("png", "pdf")]


# A hash check of a few files: not worth a cluster job.
localrules:
    verify_preregistration,


rule verify_preregistration:
    # No inputs: the frozen files are watched through params.analysis, which hashes all of preregistration/ and
    # the analysis code, so an edit reruns the verification, which then fails. As inputs they would pull in the
    # design rules that made some of them (design.smk): a fresh clone would rerun an amendment's pilot and
    # timing cells and overwrite its locked files (timing.yaml holds wall-clock times), and the lock would fail.
    output:
        f"{OUT}/logs/preregistration-v{{version}}.verified",
    params:
        analysis=ANALYSIS_FINGERPRINT,
    shell:
        "kvcert-prereg --root {REPO} verify --version {wildcards.version} > {output}.tmp && mv {output}.tmp {output}"


rule claim:
    input:
        verified=lambda wc: f"{OUT}/logs/preregistration-v{STUDIES[wc.study]['prereg']}.verified",
        item_tables=lambda wc: [f"{d}/items.parquet" for d in cell_dirs(wc.study)],
        step_tables=lambda wc: [f"{d}/steps.parquet" for d in cell_dirs(wc.study)],
    output:
        json=f"{OUT}/{{study}}/claims/{{claim}}.json",
        png=report(f"{FIG}/{{study}}/{{claim}}.png", category="Claims", subcategory="{study}",
                   caption="../report/claim.rst"),
        pdf=f"{FIG}/{{study}}/{{claim}}.pdf",
    log:
        f"{OUT}/logs/claims/{{study}}-{{claim}}.log",
    wildcard_constraints:
        study="|".join(COMPUTED) or "no-study",
        claim="|".join(CLAIMS),
    params:
        analysis=ANALYSIS_FINGERPRINT,  # reruns the claim when the analysis code or pre-registration changes
        cells=lambda wc: ",".join(cell_dirs(wc.study)),
        version=lambda wc: STUDIES[wc.study]["prereg"],
        figure_dir=lambda wc: f"{FIG}/{wc.study}",
    resources:
        mem_mb=resource("claim", "mem_mb", 4000),
        runtime=resource("claim", "runtime", 20),
    # A fixed string-hash seed: the frozen analysis builds some of a claim's detail mappings from sets of
    # strings, whose order (not their values) would otherwise change from run to run.
    shell:
        "PYTHONHASHSEED=0 kvcert-claim claim={wildcards.claim} 'cells=[{params.cells}]' out={output.json} "
        "prereg_version={params.version} figure_dir={params.figure_dir} scale={PREREG_SCALE} prereg_root={REPO} "
        "> {log} 2>&1"

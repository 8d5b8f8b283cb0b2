# kvcert: the pre-registered reproduction pipeline.
#   snakemake --cores N                                   (default scale, local)
#   snakemake --cores 2 --config scale=smoke              (all seven claims in minutes)
#   snakemake --workflow-profile workflow/profiles/slurm  (SLURM cluster)
# Stages: fetch model -> cells -> claims (per study and pre-registration version) -> tables -> notebooks.
# Every figure and table comes from exactly one rule; the rules run console scripts of the kvcert package
# and hold no attention math.

include: "workflow/rules/common.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/cells.smk"
include: "workflow/rules/claims.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/notebooks.smk"
include: "workflow/rules/exploratory.smk"
include: "workflow/rules/calibration.smk"


rule all:
    default_target: True
    input:
        TABLES if STUDIES else [],
        CLAIM_FIGURES,
        NOTEBOOKS if STUDIES else [],
        EXPLORATORY_OUTPUTS,
        CALIBRATION_OUTPUTS,


onerror:
    report_failure(log)

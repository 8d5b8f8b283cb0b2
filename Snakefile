# kvcert: the pre-registered reproduction pipeline.
#   snakemake --cores N                                   (default scale, local)
#   snakemake --cores 2 --config scale=smoke              (all seven claims in minutes)
#   snakemake --workflow-profile workflow/profiles/slurm  (SLURM cluster)
# Stages: fetch model -> cells -> claims (per study and pre-registration version) -> tables -> notebooks.
# Every figure and table of a run comes from exactly one rule and holds no attention math. A rule calls a
# console script of the kvcert package (pyproject.toml), or, where it hands a script Snakemake's job
# object (inputs by name, nested params, notebooks), a file of workflow/scripts through `script:`;
# every figure is written by kvcert.analysis.figures.save_figure.

include: "workflow/rules/common.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/cells.smk"
include: "workflow/rules/claims.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/notebooks.smk"
include: "workflow/rules/exploratory.smk"
include: "workflow/rules/calibration.smk"
include: "workflow/rules/design.smk"


rule all:
    default_target: True
    input:
        TABLES if STUDIES else [],
        f"{OUT}/claims_grid.md" if STUDIES else [],
        CLAIM_FIGURES,
        NOTEBOOKS if STUDIES else [],
        EXPLORATORY_OUTPUTS,
        CALIBRATION_OUTPUTS,


onerror:
    report_failure(log)

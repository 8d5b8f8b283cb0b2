# Exploratory analyses (labelled as such; no claim reads them). Each `exploratory:` study of a scale names its
# analysis (kvcert.scales.EXPLORATORY_ANALYSES): `sensitivity` (the default), a table and a figure of how the results
# move with the knobs its variants change (workflow/scripts/sensitivity.py; `make sensitivity`);
# `certified_budgets`, targets against fixed budgets and allocators (workflow/scripts/certified_budgets.py;
# `make certified-budgets`); or `accuracy`, accuracy per setting, policy, allocator, design and budget
# (kvcert-accuracy) and nothing more: a study whose numbers are only tabulated (the paper scale's `leaderboard`,
# beside kvpress's).
SENSITIVITY_STUDIES = [name for name, spec in EXPLORATORY.items() if spec["analysis"] == "sensitivity"]
CERTIFIED_STUDIES = [name for name, spec in EXPLORATORY.items() if spec["analysis"] == "certified_budgets"]
ACCURACY_STUDIES = [name for name, spec in EXPLORATORY.items() if spec["analysis"] == "accuracy"]
CERTIFIED_TABLES = ("summary", "coverage_by_layer", "coverage_by_step", "targets")
# The certificate's diagnostics, added after the held-out checks were read: a notebook's (rule
# notebook_certified_diagnostics; kvcert.analysis.certificate_diagnostics), published beside the study's tables.
DIAGNOSTIC_TABLES = ("certificate_flags", "certificate_items", "certificate_heads")
# Held-out checks: a certified-budgets study whose `check` names the study it is checked against; its criterion is
# the scale's locked spec (preregistration/exploratory/<scale>.yaml, kvcert.analysis.heldout), written before the
# check's cells ran.
CHECKED_STUDIES = [name for name in CERTIFIED_STUDIES if S["exploratory"][name].get("check")]

EXPLORATORY_OUTPUTS = [
    *(path for name in SENSITIVITY_STUDIES
      for path in (f"{OUT}/{name}/{name}.csv", f"{FIG}/{name}.png", f"{FIG}/{name}.pdf")),
    *(path for name in CERTIFIED_STUDIES
      for path in (*(f"{OUT}/{name}/{table}.csv" for table in CERTIFIED_TABLES),
                   f"{FIG}/{name}/{name}.png", f"{FIG}/{name}/{name}.pdf",
                   *(f"{OUT}/{name}/{table}.csv" for table in DIAGNOSTIC_TABLES),
                   f"{FIG}/{name}/certificate_flags.png", f"{FIG}/{name}/certificate_flags.pdf",
                   f"{OUT}/{name}/notebooks/certified_diagnostics.ipynb")),
    *(f"{OUT}/{name}/{table}.csv" for name in CHECKED_STUDIES for table in ("check", "decisions")),
    *(f"{OUT}/{name}/paired.csv" for name in CHECKED_STUDIES),
    *(f"{OUT}/{name}/accuracy.csv" for name in ACCURACY_STUDIES),
]


def certified_cells(study):
    """{cell: {model, variant, dirs}} of a certified-budgets study; its configuration columns (target error, delta,
    floor, allocator) the analysis reads from each cell's recorded config.yaml."""
    spec = EXPLORATORY[study]
    return {cell: {"model": c["model"], "variant": spec["variant"][cell],
                   "dirs": [d for d in cell_dirs(study) if f"/cells/{cell}/" in d]}
            for cell, c in spec["cells"].items()}


rule sensitivity_table:
    input:
        item_tables=lambda wc: [f"{d}/items.parquet" for d in cell_dirs(wc.name)],
        step_tables=lambda wc: [f"{d}/steps.parquet" for d in cell_dirs(wc.name)],
    output:
        table=f"{OUT}/{{name}}/{{name}}.csv",
        png=report(f"{FIG}/{{name}}.png", category="Exploratory"),
        pdf=f"{FIG}/{{name}}.pdf",
    log:
        f"{OUT}/logs/{{name}}.log",
    wildcard_constraints:
        name="|".join(SENSITIVITY_STUDIES) or "no-sensitivity-study",
    params:
        analysis=ANALYSIS_FINGERPRINT,
        cells=lambda wc: {variant: [d for d in cell_dirs(wc.name) if f"/cells/{variant}/" in d]
                          for variant in EXPLORATORY[wc.name]["cells"]},
        baseline=lambda wc: (S["exploratory"][wc.name].get("baseline") or next(iter(S["exploratory"][wc.name]["variants"]))),
        knobs=lambda wc: S["exploratory"][wc.name].get("knobs", {}),
    script:
        "../scripts/sensitivity.py"


rule exploratory_accuracy:
    input:
        item_tables=lambda wc: [f"{d}/items.parquet" for d in cell_dirs(wc.name)],
    output:
        f"{OUT}/{{name}}/accuracy.csv",
    log:
        f"{OUT}/logs/accuracy-{{name}}.log",
    wildcard_constraints:
        name="|".join(ACCURACY_STUDIES) or "no-exploratory-study",
    params:
        analysis=ANALYSIS_FINGERPRINT,
        cells=lambda wc: cell_dirs(wc.name),
    shell:
        "kvcert-accuracy {params.cells} --out {output} > {log} 2>&1"


rule certified_budgets:
    input:
        item_tables=lambda wc: [f"{d}/items.parquet" for d in cell_dirs(wc.name)],
        step_tables=lambda wc: [f"{d}/steps.parquet" for d in cell_dirs(wc.name)],
    output:
        **{table: f"{OUT}/{{name}}/{table}.csv" for table in CERTIFIED_TABLES},
    log:
        f"{OUT}/logs/{{name}}.log",
    wildcard_constraints:
        name="|".join(CERTIFIED_STUDIES) or "no-certified-budgets-study",
    params:
        analysis=ANALYSIS_FINGERPRINT,
        cells=lambda wc: certified_cells(wc.name),
        epsilons=lambda wc: S["exploratory"][wc.name]["targets"],
        delta=lambda wc: S["exploratory"][wc.name]["delta"],
    script:
        "../scripts/certified_budgets.py"


# The figure from the tables (tables -> figures): a committed study's figure is redrawn from its committed tables
# and its cells' recorded configs, with no cell recomputed (`make redraw SCALE=<name>`).
rule certified_budgets_figure:
    input:
        summary=f"{OUT}/{{name}}/summary.csv",
        coverage_by_step=f"{OUT}/{{name}}/coverage_by_step.csv",
        # each cell's manifest, written with its config.yaml (which the figure reads for the floor)
        manifests=lambda wc: [f"{d}/manifest.json" for d in cell_dirs(wc.name)],
    output:
        png=report(f"{FIG}/{{name}}/{{name}}.png", category="Exploratory"),
        pdf=f"{FIG}/{{name}}/{{name}}.pdf",
    wildcard_constraints:
        name="|".join(CERTIFIED_STUDIES) or "no-certified-budgets-study",
    params:
        cells=lambda wc: certified_cells(wc.name),
        epsilons=lambda wc: S["exploratory"][wc.name]["targets"],
        delta=lambda wc: S["exploratory"][wc.name]["delta"],
    script:
        "../scripts/certified_budgets_figure.py"


# Exploratory, added after the held-out checks were read (no part of any check): what the per-step certificate
# flagged, per configuration, item and head (workflow/notebooks/certified_diagnostics.py.ipynb).
rule notebook_certified_diagnostics:
    input:
        item_tables=lambda wc: [f"{d}/items.parquet" for d in cell_dirs(wc.name)],
        step_tables=lambda wc: [f"{d}/steps.parquet" for d in cell_dirs(wc.name)],
    output:
        **{table: f"{OUT}/{{name}}/{table}.csv" for table in DIAGNOSTIC_TABLES},
    log:
        notebook=f"{OUT}/logs/notebooks/certified_diagnostics-{{name}}.ipynb",
    wildcard_constraints:
        name="|".join(CERTIFIED_STUDIES) or "no-certified-budgets-study",
    params:
        analysis=ANALYSIS_FINGERPRINT,
        cells=lambda wc: certified_cells(wc.name),
        epsilons=lambda wc: S["exploratory"][wc.name]["targets"],
        delta=lambda wc: S["exploratory"][wc.name]["delta"],
    notebook:
        "../notebooks/certified_diagnostics.py.ipynb"


rule publish_certified_diagnostics:
    input:
        executed=lambda wc: [f"{OUT}/{wc.name}/{table}.csv" for table in DIAGNOSTIC_TABLES],
    output:
        f"{OUT}/{{name}}/notebooks/certified_diagnostics.ipynb",
    wildcard_constraints:
        name="|".join(CERTIFIED_STUDIES) or "no-certified-budgets-study",
    params:
        notebook=lambda wc: f"{OUT}/logs/notebooks/certified_diagnostics-{wc.name}.ipynb",
        rule="notebook_certified_diagnostics",
        inputs=lambda wc: {"item_tables": [f"{d}/items.parquet" for d in cell_dirs(wc.name)],
                           "step_tables": [f"{d}/steps.parquet" for d in cell_dirs(wc.name)]},
        outputs=lambda wc: [f"{OUT}/{wc.name}/{table}.csv" for table in DIAGNOSTIC_TABLES],
    script:
        "../scripts/publish_notebook.py"


rule certified_budgets_check:
    input:
        summary=f"{OUT}/{{name}}/summary.csv",
        study=lambda wc: S["exploratory"][wc.name]["check"]["against"],
        spec=f"preregistration/exploratory/{SCALE_NAME}.yaml",
        lock=f"preregistration/exploratory/{SCALE_NAME}.lock",
    output:
        check=f"{OUT}/{{name}}/check.csv",
        decisions=f"{OUT}/{{name}}/decisions.csv",
    log:
        f"{OUT}/logs/{{name}}-check.log",
    wildcard_constraints:
        name="|".join(CHECKED_STUDIES) or "no-held-out-check",
    params:
        analysis=ANALYSIS_FINGERPRINT,
        scale=SCALE_NAME,
        check=lambda wc: dict(S["exploratory"][wc.name]["check"]),
    script:
        "../scripts/heldout_check.py"


# Exploratory, added after held-out check 3 was read (no part of any check): what a paired exact McNemar test of each
# target against the check's fixed budget can say from the summary alone (workflow/scripts/heldout_paired.py).
rule certified_budgets_paired:
    input:
        summary=f"{OUT}/{{name}}/summary.csv",
    output:
        f"{OUT}/{{name}}/paired.csv",
    log:
        f"{OUT}/logs/{{name}}-paired.log",
    wildcard_constraints:
        name="|".join(CHECKED_STUDIES) or "no-held-out-check",
    params:
        analysis=ANALYSIS_FINGERPRINT,
        check=lambda wc: dict(S["exploratory"][wc.name]["check"]),
    script:
        "../scripts/heldout_paired.py"


# The diagnostics' figure from its table (kvcert.analysis.certificate_diagnostics.flags_figure, which the notebook
# shows): redrawn from a committed scale's certificate_flags.csv by `make redraw`, as the study's figure.
rule certificate_flags_figure:
    input:
        flags=f"{OUT}/{{name}}/certificate_flags.csv",
    output:
        png=f"{FIG}/{{name}}/certificate_flags.png",
        pdf=f"{FIG}/{{name}}/certificate_flags.pdf",
    wildcard_constraints:
        name="|".join(CERTIFIED_STUDIES) or "no-certified-budgets-study",
    params:
        delta=lambda wc: S["exploratory"][wc.name]["delta"],
    script:
        "../scripts/certificate_flags_figure.py"


# The figures drawn from tables alone (rules certified_budgets_figure, certificate_flags_figure): `make redraw
# SCALE=<name>` remakes them from a scale's committed tables with only these rules allowed, so no cell or table is
# recomputed. A target rule, as `all`: it runs nothing itself.
rule redraw:
    input:
        [f"{FIG}/{name}/{stem}.{ext}" for name in CERTIFIED_STUDIES for stem in (name, "certificate_flags")
         for ext in ("png", "pdf")],

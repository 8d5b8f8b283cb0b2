# Exploratory analyses (labelled as such; no claim reads them): for each `exploratory:` study of a scale, a
# table and a figure of how the results move with the knobs its variants change
# (workflow/scripts/sensitivity.py). `make sensitivity` runs the `sensitivity` scale.

EXPLORATORY_OUTPUTS = [path for name in EXPLORATORY
                       for path in (f"{OUT}/{name}/{name}.csv", f"{FIG}/{name}.png", f"{FIG}/{name}.pdf")]


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
        name="|".join(EXPLORATORY) or "no-exploratory-study",
    params:
        analysis=ANALYSIS_FINGERPRINT,
        cells=lambda wc: {variant: [d for d in cell_dirs(wc.name) if f"/cells/{variant}/" in d]
                          for variant in EXPLORATORY[wc.name]["cells"]},
        baseline=lambda wc: (S["exploratory"][wc.name].get("baseline") or next(iter(S["exploratory"][wc.name]["variants"]))),
        knobs=lambda wc: S["exploratory"][wc.name].get("knobs", {}),
    script:
        "../scripts/sensitivity.py"

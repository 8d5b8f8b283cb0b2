# Exploratory analyses (labelled as such; no claim reads them). An `exploratory:` study's `table:` says which
# analysis reads its cells:
# - `sensitivity` (the default): a table and a figure of how the results move with the knobs its variants
#   change (workflow/scripts/sensitivity.py). `make sensitivity` runs the `sensitivity` scale.
# - `accuracy`: accuracy per setting, policy, allocator, design and budget (kvcert-accuracy), nothing
#   more: a study whose numbers are only tabulated (the paper scale's `leaderboard`, beside kvpress's).

def exploratory_outputs(name):
    table = S["exploratory"][name].get("table", "sensitivity")
    if table == "sensitivity":
        return [f"{OUT}/{name}/{name}.csv", f"{FIG}/{name}.png", f"{FIG}/{name}.pdf"]
    if table == "accuracy":
        return [f"{OUT}/{name}/accuracy.csv"]
    fail(f"{_scale_file.name}: exploratory.{name}.table={table}: unknown; known: sensitivity, accuracy")


EXPLORATORY_OUTPUTS = [path for name in EXPLORATORY for path in exploratory_outputs(name)]
SENSITIVITY_STUDIES = [name for name in EXPLORATORY if S["exploratory"][name].get("table", "sensitivity") == "sensitivity"]
ACCURACY_STUDIES = [name for name in EXPLORATORY if S["exploratory"][name].get("table") == "accuracy"]


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
        name="|".join(SENSITIVITY_STUDIES) or "no-exploratory-study",
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

# Calibration of the certificate per layer (exploratory, beside claim C3): for every study that runs cells, the
# coverage of sqrt(trV/delta) per model x setting x policy x design x budget x layer, as a table and a figure
# (README "Calibrated certificates"). One rule, one script: workflow/scripts/calibration_by_layer.py.

CALIBRATION_STUDIES = [study for study in CELL_STUDIES if study not in EXPLORATORY]
CALIBRATION_OUTPUTS = [path for study in CALIBRATION_STUDIES
                       for path in (f"{OUT}/{study}/calibration/by_layer.csv", f"{FIG}/{study}/calibration_by_layer.png",
                                    f"{FIG}/{study}/calibration_by_layer.pdf")]


rule calibration_by_layer:
    input:
        step_tables=lambda wc: [f"{d}/steps.parquet" for d in cell_dirs(wc.study)],
        item_tables=lambda wc: [f"{d}/items.parquet" for d in cell_dirs(wc.study)],
    output:
        table=report(f"{OUT}/{{study}}/calibration/by_layer.csv", category="Tables",
                     caption="../report/calibration.rst"),
        png=report(f"{FIG}/{{study}}/calibration_by_layer.png", category="Calibration",
                   caption="../report/calibration.rst"),
        pdf=f"{FIG}/{{study}}/calibration_by_layer.pdf",
    log:
        f"{OUT}/logs/{{study}}/calibration_by_layer.log",
    wildcard_constraints:
        study="|".join(CALIBRATION_STUDIES) or "no-study",
    params:
        code=CODE_FINGERPRINT,  # the table is computed by kvcert.calibration: rerun when the library changes
        cells=lambda wc: cell_dirs(wc.study),
    resources:
        mem_mb=resource("claim", "mem_mb", 4000),
        runtime=resource("claim", "runtime", 20),
    script:
        "../scripts/calibration_by_layer.py"

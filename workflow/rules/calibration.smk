# Calibration of the certificate per layer (exploratory, beside claim C3): for every cell of the scale, the
# coverage of sqrt(trV/delta) per model x setting x policy x design x budget x layer, as a table and a figure
# (README "Calibrated certificates"). One rule, one script: workflow/scripts/calibration_by_layer.py.

CALIBRATION_OUTPUTS = [f"{OUT}/calibration/by_layer.csv", f"{FIG}/calibration_by_layer.png",
                       f"{FIG}/calibration_by_layer.pdf"]


rule calibration_by_layer:
    input:
        step_tables=CELL_STEPS,
        item_tables=CELL_ITEMS,
    output:
        table=report(f"{OUT}/calibration/by_layer.csv", category="Tables", caption="../report/calibration.rst"),
        png=report(f"{FIG}/calibration_by_layer.png", category="Calibration", caption="../report/calibration.rst"),
        pdf=f"{FIG}/calibration_by_layer.pdf",
    log:
        f"{OUT}/logs/calibration_by_layer.log",
    params:
        code=CODE_FINGERPRINT,  # the table is computed by kvcert.calibration: rerun when the library changes
        cells=CELL_DIRS,
        script=f"{REPO}/workflow/scripts/calibration_by_layer.py",
    resources:
        mem_mb=resource("claim", "mem_mb", 4000),
        runtime=resource("claim", "runtime", 20),
    shell:
        "python {params.script} --cells {params.cells} --table {output.table} --figure {output.png} > {log} 2>&1"

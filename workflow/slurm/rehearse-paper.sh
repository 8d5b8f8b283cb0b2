#!/usr/bin/env bash
# Driver for `make rehearse-paper`: docs/cluster.md's runbook, its own commands read from the page
# (workflow/slurm/runbook.py), run on the private one-node cluster with stand-in models and data.
#
# 1. stand-ins: four random-weight models with the paper scale models' architectures (bfloat16 HF
#    directories, real tokenizer) and a LongBench-format copy (python -m kvcert.standins);
# 2. cluster-up.sh; the runbook's steps as one bash script, with workflow/slurm/rehearse-site.sh in place of
#    its site settings (scale rehearse, KVCERT_SLURM_ACCOUNT / _PARTITION, KVCERT_SLURM_CELL_GPUS=0, no GPU);
#    stage, install, device check, pilot, submit through workflow/profiles/slurm, watch, resume, collect, verify;
# 3. checks (check_rehearsal.py): the sbatch command of every job against what the profile promises,
#    the groups, that local rules never went to SLURM, every job COMPLETED, claims pooled over three
#    models with per-model results, tables, figures and notebooks;
# cluster-down.sh runs on exit, unless the cluster was up before. The stand-ins answer nonsense: this rehearses
# plumbing only.
#
# Environment (all optional):
#   KVCERT_REHEARSE_TIMEOUT  hard limit for the runbook's commands, seconds (default 3000)
#   KVCERT_REHEARSE_KEEP     1: keep results/rehearse from an earlier run (resume) instead of wiping it
#   SNAKEMAKE / PYTHON       executables (default: <repo>/.venv/bin/{snakemake,python}, else PATH)
# plus the cluster knobs of common.sh (KVCERT_SLURM_DIR, ports, KVCERT_SLURM_ETC, ...).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=workflow/slurm/common.sh
source "$HERE/common.sh"
state_paths

fail() { echo "rehearse-paper: FAIL: $*" >&2; exit 1; }
say() { echo "rehearse-paper: $*" >&2; }

find_tools
RUN_TIMEOUT="${KVCERT_REHEARSE_TIMEOUT:-3000}"
OUT="results/rehearse"   # the rehearse scale's outdir (configs/scales/rehearse.yaml)
cd "$REPO_ROOT"

start_all=$SECONDS
if [[ "${KVCERT_REHEARSE_KEEP:-0}" != 1 ]]; then
  rm -rf "$OUT"
fi
mkdir -p "$OUT"
if [[ ! -f "$OUT/standins/longbench/narrativeqa.jsonl" || ! -f "$OUT/standins/models/qwen3/config.json" ]]; then
  say "building stand-in models and the LongBench-format copy in $OUT/standins"
  "$PYTHON" -m kvcert.standins --out "$OUT/standins" --head-dim 8 --stop-fraction 0.2 --longbench-tokens 2400 \
    >/dev/null 2>"$OUT/standins.log" || { tail -n 20 "$OUT/standins.log" >&2; fail "building the stand-ins failed"; }
fi

# A cluster that was up before (make slurm-up, another run) is left up, its jobs untouched; one this script
# started is stopped on exit.
was_up=0
pid="$(recorded_pid slurmctld)"
[[ -n "$pid" ]] && pid_is_ours "$pid" slurmctld && was_up=1
cleanup() {
  local rc=$?
  if ((was_up)); then
    say "leaving the cluster up: it was up before this rehearsal"
  else
    "$HERE/cluster-down.sh" || { say "cluster-down failed"; rc=1; }
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
"$HERE/cluster-up.sh" >/dev/null
# shellcheck disable=SC1090
source "$ENV_SH"
# The page's commands run as a user's shell would: without the project's environment on PATH (make rehearse-paper
# puts it there), so that the runbook's own `source .venv/bin/activate` is what finds kvcert-plan and snakemake.
RUNBOOK_PATH="$(tr ':' '\n' <<<"$PATH" | grep -vxF -e "$VENV_BIN" -e "$(realpath -m "$VENV_BIN")" | paste -sd: -)"

LOG="$OUT/snakemake.log"
SCRIPT="$OUT/runbook.sh"
"$PYTHON" "$HERE/runbook.py" --script --site "$HERE/rehearse-site.sh" >"$SCRIPT" || fail "docs/cluster.md's runbook cannot be read"
say "docs/cluster.md's runbook ($("$PYTHON" "$HERE/runbook.py" --list | wc -l) steps) as $SCRIPT  (log: $LOG, limit ${RUN_TIMEOUT}s)"
start=$SECONDS
set +e
env -u VIRTUAL_ENV PATH="$RUNBOOK_PATH" timeout -s KILL "$RUN_TIMEOUT" bash "$SCRIPT" >"$LOG" 2>&1
rc=$?
set -e
elapsed=$((SECONDS - start))
grep '^runbook: ' "$LOG" >&2 || true
if ((rc != 0)); then
  grep -v '^\s*$' "$LOG" | grep -iE 'error|fail|exception' | tail -n 30 >&2 || true
  ((rc == 137)) && fail "the runbook killed after ${RUN_TIMEOUT}s"
  fail "the runbook's commands exited with $rc (see $LOG)"
fi
say "the runbook finished in ${elapsed}s"

# The checks read the site settings the runbook ran with (partition, GPUs per cell).
# shellcheck source=workflow/slurm/rehearse-site.sh
source "$HERE/rehearse-site.sh"
"$PYTHON" "$HERE/check_rehearsal.py" --log "$LOG" --out "$OUT" --scale rehearse ||
  fail "the rehearsal's checks failed (see above)"
say "PASS in $((SECONDS - start_all))s (the runbook ${elapsed}s)"

#!/usr/bin/env bash
# Driver for `make test-slurm`: run the workflow through SLURM on a private one-node cluster and
# check that (1) every non-local job went through sbatch and completed, and (2) the claims table
# equals the one from a local run of the same configuration.
#
# Steps: cluster-up.sh -> snakemake --workflow-profile workflow/profiles/slurm-local -> checks;
# cluster-down.sh always runs on exit (trap). The SLURM job logs are left in
# <workdir>/.snakemake/slurm_logs/ and the snakemake output in <workdir>/slurm-test.log.
#
# Environment (all optional unless stated):
#   KVCERT_SLURM_REFERENCE_CLAIMS  claims.csv of the local run to compare with (required unless
#                                  KVCERT_SLURM_COMPARE=0)
#   KVCERT_SLURM_COMPARE           1 (default) compare claims; 0 skip the comparison
#   KVCERT_SLURM_SNAKEFILE         default <repo>/workflow/Snakefile
#   KVCERT_SLURM_WORKDIR           snakemake --directory (default <repo>/outputs/slurm-test; wiped
#                                  at start if it was made by this script)
#   KVCERT_SLURM_CONFIG            --config arguments, space separated (default "scale=smoke")
#   KVCERT_SLURM_TARGETS           snakemake targets (default: the Snakefile's default target)
#   KVCERT_SLURM_EXTRA_ARGS        extra snakemake arguments, space separated
#   KVCERT_SLURM_CLAIMS            claims file relative to the workdir (default results/claims.csv)
#   KVCERT_SLURM_IGNORE_COLUMNS    comma-separated claim columns not compared (e.g. timings)
#   KVCERT_SLURM_RTOL              relative tolerance for float columns (default 0 = exact)
#   KVCERT_SLURM_MIN_JOBS          minimum number of SLURM jobs expected (default 3)
#   KVCERT_SLURM_TIMEOUT           hard limit for the snakemake run, seconds (default 1800)
#   KVCERT_SLURM_KEEP_UP           1: leave the cluster running afterwards (default 0)
#   SNAKEMAKE / PYTHON             executables (default: <repo>/.venv/bin/{snakemake,python})
# plus the cluster knobs of common.sh (KVCERT_SLURM_DIR, ports, ...).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=workflow/slurm/common.sh
source "$HERE/common.sh"
state_paths

fail() { echo "test-slurm: FAIL: $*" >&2; exit 1; }
say() { echo "test-slurm: $*" >&2; }

find_tools

SNAKEFILE="${KVCERT_SLURM_SNAKEFILE:-$REPO_ROOT/workflow/Snakefile}"
WORKDIR="$(realpath -m "${KVCERT_SLURM_WORKDIR:-$REPO_ROOT/outputs/slurm-test}")"
CONFIG="${KVCERT_SLURM_CONFIG-scale=smoke}"
TARGETS="${KVCERT_SLURM_TARGETS:-}"
EXTRA_ARGS="${KVCERT_SLURM_EXTRA_ARGS:-}"
CLAIMS_REL="${KVCERT_SLURM_CLAIMS:-results/claims.csv}"
COMPARE="${KVCERT_SLURM_COMPARE:-1}"
REFERENCE="${KVCERT_SLURM_REFERENCE_CLAIMS:-}"
MIN_JOBS="${KVCERT_SLURM_MIN_JOBS:-3}"
RUN_TIMEOUT="${KVCERT_SLURM_TIMEOUT:-1800}"
PROFILE="$REPO_ROOT/workflow/profiles/slurm-local"

[[ -f "$SNAKEFILE" ]] || fail "no Snakefile at $SNAKEFILE (set KVCERT_SLURM_SNAKEFILE)"
if [[ "$COMPARE" == 1 ]]; then
  [[ -n "$REFERENCE" ]] || fail "set KVCERT_SLURM_REFERENCE_CLAIMS to the local run's claims.csv (or KVCERT_SLURM_COMPARE=0)"
  REFERENCE="$(realpath -m "$REFERENCE")"
  [[ -f "$REFERENCE" ]] || fail "reference claims not found: $REFERENCE"
fi

cleanup() {
  local rc=$?
  if [[ "${KVCERT_SLURM_KEEP_UP:-0}" == 1 ]]; then
    say "leaving the cluster up (KVCERT_SLURM_KEEP_UP=1); stop it with $HERE/cluster-down.sh"
  else
    "$HERE/cluster-down.sh" || { say "cluster-down failed"; rc=1; }
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# fresh work dir (only ever delete one this script created)
if [[ -e "$WORKDIR" ]]; then
  [[ -f "$WORKDIR/.kvcert-slurm-test" ]] || fail "$WORKDIR exists and was not made by this script; choose another KVCERT_SLURM_WORKDIR"
  rm -rf "$WORKDIR"
fi
mkdir -p "$WORKDIR"
touch "$WORKDIR/.kvcert-slurm-test"

"$HERE/cluster-up.sh" >/dev/null
# shellcheck disable=SC1090
source "$ENV_SH"
export PATH="$VENV_BIN:$PATH"

args=(--snakefile "$SNAKEFILE" --workflow-profile "$PROFILE" --directory "$WORKDIR")
# shellcheck disable=SC2206
[[ -n "$CONFIG" ]] && args+=(--config $CONFIG)
# shellcheck disable=SC2206
[[ -n "$EXTRA_ARGS" ]] && args+=($EXTRA_ARGS)
# shellcheck disable=SC2206
[[ -n "$TARGETS" ]] && args+=($TARGETS)

LOG="$WORKDIR/slurm-test.log"
say "snakemake ${args[*]}  (log: $LOG, limit ${RUN_TIMEOUT}s)"
start=$SECONDS
set +e
timeout -s KILL "$RUN_TIMEOUT" "$SNAKEMAKE" "${args[@]}" >"$LOG" 2>&1
rc=$?
set -e
elapsed=$((SECONDS - start))
if ((rc != 0)); then
  tail -n 40 "$LOG" >&2
  ((rc == 137)) && fail "snakemake killed after ${RUN_TIMEOUT}s"
  fail "snakemake exited with $rc (see $LOG)"
fi
say "snakemake finished in ${elapsed}s"

# ---- check 1: every non-local job was a SLURM job that completed, with its log file
# lines: "<jobid> <log path>" from "... has been submitted with SLURM jobid N (log: PATH)."
submissions="$(sed -n 's/.*has been submitted with SLURM jobid \([0-9][0-9]*\) (log: \(.*\))\.$/\1 \2/p' "$LOG")"
mapfile -t jobids < <(awk 'NF { print $1 }' <<<"$submissions" | sort -un)
n_rules="$(grep -cE '^rule [A-Za-z0-9_]+:$' "$LOG" || true)"
n_single="$(grep -cE '^Job [0-9]+ has been submitted with SLURM jobid' "$LOG" || true)"
((${#jobids[@]} >= MIN_JOBS)) || fail "only ${#jobids[@]} SLURM jobs submitted (expected >= $MIN_JOBS)"
((n_single >= n_rules)) || fail "$n_rules rule jobs but only $n_single SLURM submissions: some jobs ran outside SLURM"
SLURM_LOGS="$WORKDIR/.snakemake/slurm_logs"
while read -r id path; do
  [[ -n "$id" ]] || continue
  [[ -s "$path" ]] || fail "SLURM log of job $id missing or empty: $path"
  info="$(scontrol show job "$id" 2>/dev/null || true)"
  [[ "$info" == *"JobState=COMPLETED"* && "$info" == *"ExitCode=0:0"* ]] ||
    fail "SLURM job $id did not complete cleanly: $(grep -oE '(JobState|ExitCode)=[^ ]+' <<<"$info" | tr '\n' ' ')"
done <<<"$submissions"
n_logs="$(find "$SLURM_LOGS" -name '*.log' -type f | wc -l)"
say "ok: ${#jobids[@]} SLURM jobs ($n_rules rule jobs), all COMPLETED, $n_logs log files in $SLURM_LOGS"
say "mean wall time per SLURM job: $((elapsed / ${#jobids[@]}))s"

# ---- check 2: claims equal the local run's
if [[ "$COMPARE" == 1 ]]; then
  CLAIMS="$WORKDIR/$CLAIMS_REL"
  [[ -f "$CLAIMS" ]] || fail "the SLURM run produced no $CLAIMS_REL"
  KVCERT_A="$CLAIMS" KVCERT_B="$REFERENCE" \
    KVCERT_IGNORE="${KVCERT_SLURM_IGNORE_COLUMNS:-}" KVCERT_RTOL="${KVCERT_SLURM_RTOL:-0}" \
    "$PYTHON" - <<'EOF' || fail "claims differ from the local run (see above)"
import os, sys
import pandas as pd

a_path, b_path = os.environ["KVCERT_A"], os.environ["KVCERT_B"]
ignore = [c for c in os.environ.get("KVCERT_IGNORE", "").split(",") if c]
rtol = float(os.environ.get("KVCERT_RTOL", "0"))

def load(path):
    df = pd.read_csv(path)
    df = df.drop(columns=[c for c in ignore if c in df.columns])
    df = df[sorted(df.columns)]
    return df.sort_values(list(df.columns), kind="mergesort").reset_index(drop=True)

a, b = load(a_path), load(b_path)
if list(a.columns) != list(b.columns):
    print(f"column sets differ: only SLURM {sorted(set(a.columns) - set(b.columns))}, "
          f"only local {sorted(set(b.columns) - set(a.columns))}", file=sys.stderr)
    sys.exit(1)
try:
    if rtol > 0:
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=rtol, check_dtype=False)
    else:
        pd.testing.assert_frame_equal(a, b, check_exact=True)
except AssertionError as e:
    print(f"{a_path}\n  vs {b_path}:\n{e}", file=sys.stderr)
    sys.exit(1)
print(f"test-slurm: ok: {len(a)} claims identical to {b_path}", file=sys.stderr)
EOF
fi
say "PASS"

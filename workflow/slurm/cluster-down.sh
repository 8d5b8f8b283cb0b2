#!/usr/bin/env bash
# Stop the one-node SLURM cluster started by cluster-up.sh: only the daemons whose PIDs it recorded
# in the state dir (never by name), after cancelling the cluster's jobs; removes
# /etc/slurm/slurm.conf only if cluster-up.sh wrote it. Idempotent; exit 0 when nothing runs.
# Logs and the state dir are kept (rm -rf the state dir to forget everything).
set -euo pipefail
# shellcheck source=workflow/slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
state_paths

if [[ ! -d "$STATE_DIR" ]]; then
  exit 0
fi

alive() { pid_is_ours "$(recorded_pid "$1")" "$1"; }

# 1. cancel jobs while the controller is still up, so no job step outlives the cluster
if alive slurmctld && [[ -x "$BIN_DIR/squeue" ]]; then
  jobs="$(timeout 15 "$BIN_DIR/squeue" -h -o '%i' 2>/dev/null || true)"
  if [[ -n "$jobs" ]]; then
    log "cancelling jobs: $(echo "$jobs" | tr '\n' ' ')"
    # shellcheck disable=SC2086
    timeout 15 "$BIN_DIR/scancel" $jobs >/dev/null 2>&1 || true
    for _ in $(seq 1 40); do
      left="$(timeout 10 "$BIN_DIR/squeue" -h -t PD,R,CG,CF,S -o '%i' 2>/dev/null || true)"
      [[ -z "$left" ]] && break
      sleep 0.5
    done
  fi
fi

# job step daemons (slurmstepd) are detached from slurmd: find those bound to our spool dir sockets
stepd_pids() {
  [[ -d "$SPOOL_D" ]] || return 0
  local inodes p fd
  inodes="$(awk -v d="$SPOOL_D/" 'index($NF, d) == 1 { print $7 }' /proc/net/unix 2>/dev/null | sort -u)"
  [[ -n "$inodes" ]] || return 0
  for p in /proc/[0-9]*; do
    [[ "$(cat "$p/comm" 2>/dev/null)" == slurmstepd ]] || continue
    for fd in "$p"/fd/*; do
      if grep -qxF "$(readlink "$fd" 2>/dev/null | sed -n 's/^socket:\[\([0-9]*\)\]$/\1/p')" <<<"$inodes"; then
        echo "${p#/proc/}"
        break
      fi
    done 2>/dev/null
  done
}

stop_pid() { # name pid
  local name="$1" pid="$2" _
  pid_is_ours "$pid" "$name" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do
    pid_is_ours "$pid" "$name" || { log "stopped $name (pid $pid)"; return 0; }
    sleep 0.1
  done
  log "$name (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    pid_is_ours "$pid" "$name" || return 0
    sleep 0.1
  done
  die "could not stop $name (pid $pid)"
}

# PID and all its descendants
tree() {
  local p
  echo "$1"
  for p in $(ps -e -o pid= -o ppid= | awk -v pp="$1" '$2 == pp { print $1 }'); do
    tree "$p"
  done
}

for p in $(stepd_pids); do
  victims="$(tree "$p" | tr '\n' ' ')"
  log "stopping leftover job step (slurmstepd pid $p and its processes: $victims)"
  # shellcheck disable=SC2086
  kill -KILL $victims 2>/dev/null || true
done

# 2. daemons, in reverse start order; every pid ever recorded (covers repeated ups)
if [[ -f "$PIDS_FILE" ]]; then
  for name in slurmd slurmctld munged; do
    while read -r pid; do
      stop_pid "$name" "$pid"
    done < <(awk -v n="$name" '$1 == n { print $2 }' "$PIDS_FILE" | sort -u)
  done
  : >"$PIDS_FILE"
fi

# 3. /etc/slurm/slurm.conf only if we wrote it and it still carries our marker
if [[ -f "$ETC_FLAG" ]]; then
  if [[ -f "$ETC_CONF" ]] && grep -qxF "$MARKER" "$ETC_CONF" && grep -qxF "# state dir: $STATE_DIR" "$ETC_CONF"; then
    rm -f "$ETC_CONF"
  fi
  rm -f "$ETC_FLAG"
fi
rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
exit 0

#!/usr/bin/env bash
# Bring up a private one-node SLURM cluster on 127.0.0.1 (munged + slurmctld + slurmd).
#
# Idempotent: daemons that are already running from this state dir are left alone.
# Everything lives in the state dir (default <repo>/.slurm, override with KVCERT_SLURM_DIR):
# munge key/socket, slurm.conf, spool, logs, pid files, and bin/ with sbatch/srun/... wrappers
# that export SLURM_CONF. Use the cluster with:   source <state dir>/env.sh
# The snakemake SLURM job-step plugin drops SLURM_* variables before its inner srun, so SLURM_CONF
# alone is not enough: the bin/ wrappers (first on PATH, exported into jobs) set it again, and the
# config is also installed as /etc/slurm/slurm.conf when that file is absent or ours (KVCERT_SLURM_ETC=0
# disables this). Stop with cluster-down.sh. Needs root (slurmd must run as root).
set -euo pipefail
# shellcheck source=workflow/slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
state_paths

case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/sbin:/sbin" ;; esac
[[ "$(id -u)" == 0 ]] || die "must run as root (slurmd needs root); try: sudo $0"

# ---------------------------------------------------------------- packages
install_packages() {
  local need=()
  command -v munged >/dev/null 2>&1 || need+=(munge)
  command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
  command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
  ((${#need[@]} == 0)) && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing ${need[*]} and no apt-get to install them"
  log "installing ${need[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends "${need[@]}" >"/tmp/kvcert-slurm-apt.$$.log" 2>&1; then
    apt-get update -qq >>"/tmp/kvcert-slurm-apt.$$.log" 2>&1 || true
    apt-get install -y -qq --no-install-recommends "${need[@]}" >>"/tmp/kvcert-slurm-apt.$$.log" 2>&1 ||
      { tail -n 20 "/tmp/kvcert-slurm-apt.$$.log" >&2; die "apt-get install ${need[*]} failed"; }
  fi
  rm -f "/tmp/kvcert-slurm-apt.$$.log"
}
install_packages

# ---------------------------------------------------------------- state dir
mkdir -p "$STATE_DIR"/{etc,run,log,bin} "$SPOOL_CTLD" "$SPOOL_D" "$MUNGE_DIR"
chmod 0755 "$STATE_DIR" "$MUNGE_DIR"
# munge socket path must fit in sockaddr_un (108 bytes)
((${#MUNGE_SOCKET} < 100)) || die "state dir path too long for a unix socket: $STATE_DIR (set KVCERT_SLURM_DIR to a shorter path)"

if [[ ! -s "$MUNGE_KEY" ]]; then
  umask 077
  dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
  umask 022
fi
chmod 0600 "$MUNGE_KEY"

any_running() {
  local n p
  for n in munged slurmctld slurmd; do
    p="$(recorded_pid "$n")"
    [[ -n "$p" ]] && pid_is_ours "$p" "$n" && return 0
  done
  return 1
}

# ---------------------------------------------------------------- slurm.conf
# One PartitionName line per name of KVCERT_SLURM_PARTITIONS, all on the one node; a name ending in '*' is the
# default partition (as sinfo shows it). With no '*', a job must name its partition (-p), as on many sites.
partition_lines() {
  local name default names
  read -r -a names <<<"$PARTITIONS"
  ((${#names[@]} > 0)) || die "KVCERT_SLURM_PARTITIONS is empty: name at least one partition"
  for name in "${names[@]}"; do
    default=NO
    [[ "$name" == *'*' ]] && { default=YES; name="${name%'*'}"; }
    [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || die "KVCERT_SLURM_PARTITIONS: '$name' is not a partition name (letters, digits, _ . -)"
    echo "PartitionName=$name Nodes=localhost Default=$default MaxTime=INFINITE State=UP"
  done
}
write_conf() {
  local cpus mem_avail_mb real_mem def_mem partitions
  partitions="$(partition_lines)" || exit 1
  cpus="$(nproc --all)"
  mem_avail_mb="$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)"
  real_mem=$((mem_avail_mb * 90 / 100))
  ((real_mem >= 512)) || die "too little free memory for a node: ${mem_avail_mb} MB available"
  # default per-CPU memory for jobs that do not ask (otherwise one job takes the whole node)
  def_mem=$((real_mem / cpus / 2))
  ((def_mem > 1024)) && def_mem=1024
  cat >"$CONF.tmp" <<EOF
$MARKER
# state dir: $STATE_DIR
ClusterName=kvcert
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$def_mem
# finished jobs stay visible to squeue/scontrol for an hour (status polling, and the checks after a run)
MinJobAge=3600
ReturnToService=2
# reject jobs that can never run here (instead of leaving them pending forever)
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
InactiveLimit=0
KillWait=5
Waittime=0
StateSaveLocation=$SPOOL_CTLD
SlurmdSpoolDir=$SPOOL_D
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=$cpus RealMemory=$real_mem State=UNKNOWN
$partitions
EOF
  mv -f "$CONF.tmp" "$CONF"
}

if ! any_running || [[ ! -s "$CONF" ]]; then
  write_conf
fi

# /etc/slurm/slurm.conf: only when absent or written by us
if [[ "$WRITE_ETC" == 1 ]]; then
  if [[ ! -e "$ETC_CONF" ]] || grep -qxF "$MARKER" "$ETC_CONF" 2>/dev/null; then
    mkdir -p "$(dirname "$ETC_CONF")"
    cp -f "$CONF" "$ETC_CONF.kvcert.tmp" && mv -f "$ETC_CONF.kvcert.tmp" "$ETC_CONF"
    echo "$ETC_CONF" >"$ETC_FLAG"
  else
    log "note: $ETC_CONF belongs to someone else; leaving it alone (use $ENV_SH)"
  fi
fi

# ---------------------------------------------------------------- client wrappers + env.sh
for tool in sbatch srun salloc squeue scancel sinfo scontrol sacct sacctmgr sshare sstat sprio; do
  real=""
  IFS=: read -r -a path_parts <<<"$PATH"
  for d in "${path_parts[@]}"; do
    [[ -z "$d" || "$(realpath -m "$d")" == "$BIN_DIR" ]] && continue
    if [[ -x "$d/$tool" && ! -d "$d/$tool" ]]; then real="$d/$tool"; break; fi
  done
  [[ -n "$real" ]] || continue
  cat >"$BIN_DIR/$tool.tmp" <<EOF
#!/bin/sh
# kvcert local cluster wrapper: restores SLURM_CONF (dropped by some job launchers)
SLURM_CONF='$CONF'
export SLURM_CONF
exec '$real' "\$@"
EOF
  chmod 0755 "$BIN_DIR/$tool.tmp"
  mv -f "$BIN_DIR/$tool.tmp" "$BIN_DIR/$tool"
done
cat >"$ENV_SH" <<EOF
# source this file to use the kvcert local SLURM cluster
export SLURM_CONF='$CONF'
case ":\$PATH:" in *":$BIN_DIR:"*) ;; *) export PATH='$BIN_DIR':"\$PATH" ;; esac
EOF

# ---------------------------------------------------------------- daemons
record_pid() { echo "$1 $2" >>"$PIDS_FILE"; }

# start NAME PIDFILE -- CMD...: start in its own session, stdio to a log, record its pid
start_daemon() {
  local name="$1" pidfile="$2"
  shift 3
  local p
  p="$(recorded_pid "$name")"
  if [[ -n "$p" ]] && pid_is_ours "$p" "$name"; then
    log "$name already running (pid $p)"
    return 0
  fi
  rm -f "$pidfile"
  setsid "$@" </dev/null >>"$LOG_DIR/$name.stdout" 2>&1 &
  p=$!
  record_pid "$name" "$p"
  log "started $name (pid $p)"
}

fail_with_logs() {
  local f n
  echo "slurm-cluster: error: $*" >&2
  for n in munged slurmctld slurmd; do
    for f in "$LOG_DIR/$n.log" "$LOG_DIR/$n.stdout"; do
      [[ -s "$f" ]] || continue
      echo "----- tail $f" >&2
      tail -n 12 "$f" >&2
    done
  done
  # do not leave half a cluster behind
  "$SLURM_SCRIPT_DIR/cluster-down.sh" || true
  exit 1
}

# wait_alive NAME PID: the daemon has replaced the forked shell (exec done) and stays up for ~1 s.
# Right after `setsid CMD &` the PID may still be the forked shell, whose command line does not name
# the daemon yet; that is "starting", not "dead". Only a vanished or zombie PID counts as dead.
wait_alive() {
  local name="$1" pid="$2" seen=0 _ status
  for _ in $(seq 1 100); do
    if ! pid_exists "$pid"; then
      status=""
      wait "$pid" 2>/dev/null || status=" (exit status $?)"
      fail_with_logs "$name (pid $pid) exited right after start$status"
    fi
    if pid_is_ours "$pid" "$name"; then
      seen=$((seen + 1))
      ((seen >= 5)) && return 0
    fi
    sleep 0.2
  done
  fail_with_logs "$name (pid $pid) did not come up within 20 s"
}

touch "$PIDS_FILE"

start_daemon munged "$RUN_DIR/munged.pid" -- \
  munged -F --force --socket="$MUNGE_SOCKET" --key-file="$MUNGE_KEY" \
  --pid-file="$RUN_DIR/munged.pid" --log-file="$LOG_DIR/munged.log" --seed-file="$MUNGE_SEED"
for _ in $(seq 1 50); do [[ -S "$MUNGE_SOCKET" ]] && break; sleep 0.1; done
[[ -S "$MUNGE_SOCKET" ]] || fail_with_logs "munged did not create its socket $MUNGE_SOCKET"
wait_alive munged "$(recorded_pid munged)"

export SLURM_CONF="$CONF"
# -c: start with a clean job state (this cluster is disposable)
start_daemon slurmctld "$RUN_DIR/slurmctld.pid" -- slurmctld -D -c -f "$CONF"
wait_alive slurmctld "$(recorded_pid slurmctld)"
start_daemon slurmd "$RUN_DIR/slurmd.pid" -- slurmd -D -N localhost -f "$CONF"
wait_alive slurmd "$(recorded_pid slurmd)"

# ---------------------------------------------------------------- wait for the node
deadline=$((SECONDS + WAIT_S))
state=""
while ((SECONDS < deadline)); do
  state="$(timeout 15 "$BIN_DIR/sinfo" -h -N -n localhost -o '%T' 2>/dev/null | head -n1 || true)"
  case "$state" in
    idle | mixed | allocated | completing) break ;;
    down* | drain*) timeout 10 "$BIN_DIR/scontrol" update nodename=localhost state=resume >/dev/null 2>&1 || true ;;
  esac
  for n in munged slurmctld slurmd; do
    pid_is_ours "$(recorded_pid "$n")" "$n" || fail_with_logs "$n died while waiting for the node"
  done
  sleep 0.5
done
case "$state" in
  idle | mixed | allocated | completing) ;;
  *) fail_with_logs "node 'localhost' not ready after ${WAIT_S}s (state: '${state:-no answer from slurmctld}')" ;;
esac

log "cluster up: node localhost $state; state dir $STATE_DIR"
log "use it with: source $ENV_SH"
echo "$ENV_SH"

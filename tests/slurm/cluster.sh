#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the cluster-profile tests
# (tests/test_slurm.py) and as a worked example (README, "Running on a SLURM cluster").
#
#   tests/slurm/cluster.sh up   STATE_DIR   install (Debian's slurm-wlm + munge, if missing),
#                                           configure, start munged/slurmctld/slurmd, wait idle
#   tests/slurm/cluster.sh down STATE_DIR   stop the daemons that `up` started, by their PIDs,
#                                           and remove the slurm.conf it wrote
#
# Exit codes of `up`: 0 running; 3 SLURM cannot be set up here (not root, no apt-get, the
# install failed, or an /etc/slurm/slurm.conf that this script did not write: a real cluster's
# configuration is never touched); the reason is the last line on stderr. Anything else: error.
#
# slurm.conf must sit at its default path: the Snakemake SLURM plugin strips SLURM_* variables
# from job environments, so SLURM_CONF would not reach the jobs. `sacct` needs the accounting
# daemon (slurmdbd and a database), which a one-node test cluster does without: Snakemake checks
# jobs with squeue, and every finished job is one line of STATE_DIR/log/jobcomp.txt (the
# job-completion log: JobId, Name, JobState, NodeList, times), the record sacct would show.
set -euo pipefail

MARK="# fedforget test cluster (tests/slurm/cluster.sh)"
CONF=/etc/slurm/slurm.conf

cannot() { echo "SLURM cannot be set up here: $*" >&2; exit 3; }

up() {
  local state=$1
  [ "$(id -u)" -eq 0 ] || cannot "not root (the daemons and /etc/slurm/slurm.conf need root)"
  if [ -e "$CONF" ] && ! head -n1 "$CONF" | grep -qF "$MARK"; then
    cannot "$CONF exists and was not written by this script (a real cluster's configuration is not touched)"
  fi
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    command -v apt-get >/dev/null || cannot "slurmctld/munged are not installed and there is no apt-get"
    [ "${FEDFORGET_SLURM_INSTALL:-}" = 1 ] || cannot "SLURM is not installed and FEDFORGET_SLURM_INSTALL=1 is not set (only CI installs system packages)"
    echo "installing slurm-wlm and munge (apt-get)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } \
      >"$state.apt.log" 2>&1 || cannot "apt-get install slurm-wlm munge failed (log: $state.apt.log)"
  fi
  [ -s /etc/munge/munge.key ] || cannot "/etc/munge/munge.key is missing (reinstall munge)"
  mkdir -p "$state"/{save,spool,run,log}
  chown slurm:slurm "$state/save" "$state/log"  # slurmctld (the slurm user) writes both
  local cpus mem
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)  # MB, headroom for the OS
  mkdir -p /etc/slurm
  cat >"$CONF" <<EOF
$MARK
ClusterName=fedforget
SlurmctldHost=localhost
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/save
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$state/log/jobcomp.txt
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  chmod 644 "$CONF"
  mkdir -p /run/munge && chown munge:munge /run/munge
  if ! pgrep -x munged >/dev/null; then
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$state/run/munged.pid"  # ours to stop
  fi
  /usr/sbin/slurmctld
  /usr/sbin/slurmd -N localhost
  local deadline=$((SECONDS + 30)) pid
  while [ $SECONDS -lt $deadline ]; do
    if timeout 5 sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      echo "SLURM up: $(sinfo -h -o '%P %D %c %m %T')" >&2
      return 0
    fi
    for f in slurmctld slurmd; do
      pid=$(cat "$state/run/$f.pid" 2>/dev/null || true)
      if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
        echo "$f exited: $(grep -h -E 'fatal|error' "$state/log/$f.log" 2>/dev/null | tail -n 1)" >&2
        down "$state"
        exit 1
      fi
    done
    sleep 0.5
  done
  echo "SLURM did not become idle in 30 s; logs in $state/log" >&2
  down "$state"
  exit 1
}

down() {
  local state=$1 f pid
  # the configuration goes with the cluster: with slurm.conf left and no controller, every
  # `scontrol show config` waits 10 s for it, and the SLURM plugin runs one each time any
  # Snakemake starts (any executor); with no slurm.conf it fails at once
  if [ -e "$CONF" ] && head -n1 "$CONF" | grep -qF "$MARK"; then rm -f "$CONF"; fi
  for f in slurmd slurmctld munged; do
    [ -s "$state/run/$f.pid" ] || continue
    pid=$(cat "$state/run/$f.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$state/run/$f.pid"
  done
}

case "${1:-}" in
  up) up "${2:?state dir}" ;;
  down) down "${2:?state dir}" ;;
  *) echo "usage: $0 up|down STATE_DIR" >&2; exit 2 ;;
esac

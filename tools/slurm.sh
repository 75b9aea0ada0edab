#!/usr/bin/env bash
# A real SLURM on one machine (root): munged, slurmctld on host 1 and one slurmd per namespace host of a
# tools/cluster.sh cluster, each node's NodeAddr its host's own address (10.77.0.I). Debian: slurm-wlm munge.
#
#   tools/slurm.sh up N [--cpus C]          a cluster of N hosts running SLURM; prints its folder D
#   tools/slurm.sh down D                   stop the daemons by their pid files, take the hosts down, remove D
#   tools/slurm.sh exec D [I] -- CMD ...    run CMD on host I (default 1, the controller) with SLURM_CONF set
#   tools/slurm.sh with N -- CMD ...        up, run CMD with SLURM_DIR=D (and SLURM_CONF) set, always down
#
# Nodes are host1..hostN (each slurmd finds its name from its host's hostname), C CPUs each (default 1), in one
# partition `debug`. Clients (sbatch, srun, squeue, scontrol) reach slurmctld at 10.77.0.1, an address that exists
# only inside the cluster: run them on a host (`exec`). Hosts know each other by name (cluster.sh's /etc/hosts).
# Jobs run as root. Everything lives in D: config, munge key and socket, state, spool, logs.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CLUSTER="$HERE/cluster.sh"
die() { echo "slurm.sh: $*" >&2; exit 2; }

need() {
  [ "$(id -u)" = 0 ] || die "SLURM's daemons need root here (running as uid $(id -u))"
  local c missing=()
  for c in munged slurmctld slurmd sbatch; do command -v $c >/dev/null || missing+=($c); done
  [ ${#missing[@]} -eq 0 ] || die "no ${missing[*]}: install them with \`apt-get install -y slurm-wlm munge\`"
}
on() {  # on D I CMD ...: run CMD on host I of the cluster in D, with its SLURM_CONF
  local d=$1 i=$2; shift 2
  SLURM_CONF="$d/slurm.conf" bash "$CLUSTER" exec --prefix "$(cat "$d/prefix")" "$i" -- "$@"
}

config() {  # config D N CPUS
  local d=$1 n=$2 cpus=$3 i
  cat <<C
# written by tools/slurm.sh: a SLURM on namespace hosts (no cgroups needed, no accounting)
ClusterName=dtnb
SlurmctldHost=host1(10.77.0.1)
AuthType=auth/munge
AuthInfo=socket=$d/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool/%n
SlurmctldPidFile=$d/run/slurmctld.pid
SlurmdPidFile=$d/run/slurmd.%n.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
KillWait=5
C
  for i in $(seq 1 "$n"); do echo "NodeName=host$i NodeAddr=10.77.0.$i CPUs=$cpus State=UNKNOWN"; done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
}

up() {
  local n=$1 cpus=$2 d p i j
  need
  d=$(mktemp -d /tmp/dtnb-slurm.XXXXXX)
  trap 'down "$d" >/dev/null 2>&1' ERR
  mkdir -p "$d"/{munge,state,run,log} && chmod 700 "$d/munge"
  p=$(bash "$CLUSTER" up "$n"); echo "$p" > "$d/prefix"
  for i in $(seq 1 "$n"); do mkdir -p "$d/spool/host$i"; done
  config "$d" "$n" "$cpus" > "$d/slurm.conf"
  echo "CgroupPlugin=cgroup/v1" > "$d/cgroup.conf"  # read by slurmd even with proctrack/linuxproc
  head -c 1024 /dev/urandom > "$d/munge/munge.key" && chmod 400 "$d/munge/munge.key"
  on "$d" 1 munged --force --socket="$d/munge/munge.socket" --key-file="$d/munge/munge.key" \
     --log-file="$d/log/munged.log" --pid-file="$d/run/munged.pid" --seed-file="$d/munge/seed"
  on "$d" 1 slurmctld -f "$d/slurm.conf"
  for i in $(seq 1 "$n"); do on "$d" "$i" slurmd -f "$d/slurm.conf"; done
  for _ in $(seq 1 150); do  # up to 30 s for every node to report idle
    [ "$(on "$d" 1 sinfo -h -N -o %T 2>/dev/null | grep -cx idle)" = "$n" ] && { trap - ERR; echo "$d"; return; }
    sleep 0.2
  done
  echo "slurm.sh: the nodes did not become idle in 30 s; logs in $d/log:" >&2
  tail -n 5 "$d"/log/*.log >&2 || true
  down "$d"; exit 1
}

down() {
  local d=$1 f pids=()
  [ -f "$d/slurm.conf" ] || die "down: $d is not a folder made by \`slurm.sh up\`"
  for f in "$d"/run/slurmd.*.pid "$d/run/slurmctld.pid" "$d/run/munged.pid"; do
    [ -f "$f" ] && pids+=($(cat "$f"))
  done
  [ ${#pids[@]} -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 1 50); do  # up to 5 s for them to end
    kill -0 "${pids[@]}" 2>/dev/null || break; sleep 0.1
  done
  [ ${#pids[@]} -eq 0 ] || kill -KILL "${pids[@]}" 2>/dev/null || true
  [ ! -f "$d/prefix" ] || bash "$CLUSTER" down --prefix "$(cat "$d/prefix")"  # what jobs left on the hosts
  rm -rf "$d"
}

cmd=${1:-}; shift || true
case "$cmd" in
  up)   n=${1:-}; cpus=1; shift || true
        [ "${1:-}" != --cpus ] || { cpus=${2:-}; shift 2; }
        [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 20 ] || die "up N: N hosts, 1 to 20, not '$n'"
        [[ "$cpus" =~ ^[0-9]+$ ]] && [ "$cpus" -ge 1 ] || die "--cpus C: a whole number >= 1, not '$cpus'"
        up "$n" "$cpus" ;;
  down) [ -n "${1:-}" ] || die "down D: the folder \`slurm.sh up\` printed"; down "$1" ;;
  exec) d=${1:-}; shift || true; i=1
        [ -f "$d/slurm.conf" ] || die "exec D [I] -- CMD: D is the folder \`slurm.sh up\` printed"
        [ "${1:-}" = -- ] || { i=$1; shift; }
        [ "${1:-}" = -- ] || die "exec D [I] -- CMD"; shift
        on "$d" "$i" "$@" ;;
  with) n=${1:-}; shift || true; [ "${1:-}" = -- ] || die "with N -- CMD ..."; shift
        d=$(bash "$0" up "$n")
        trap 'down "$d"' EXIT
        trap 'exit 130' INT TERM
        SLURM_DIR=$d SLURM_CONF=$d/slurm.conf "$@" ;;
  *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# A real Slurm on this one machine, for tests: the hosts of scripts/netns-cluster.sh (network
# namespaces with their own eth0, address and sshd), each with its own slurmd, a slurmctld in the
# root namespace (the launch host, on the cluster's bridge), and a private munged for all.
#
#   scripts/slurm-cluster.sh up K [NAME]     build K hosts of cluster NAME (default nrs) with
#                                            Slurm; prints the path of its slurm.env (SLURM_CONF,
#                                            ...) as the last line
#   scripts/slurm-cluster.sh down [NAME]     stop the daemons and remove the hosts (idempotent)
#
# By hand:  . "$(scripts/slurm-cluster.sh up 3 | tail -1)"; salloc -N3 nrun --nproc 2 x.py
#
# Needs root, the netns cluster's tools, and slurm-wlm + munge (installed here on Debian when
# missing: `apt-get install --no-install-recommends slurm-wlm munge`).
#
# Facts it relies on (see the shared reference on Slurm): slurmd is started with nsenter --net
# (ip netns exec remounts /sys and hides the cgroup tree slurmd 22.05 wants); each daemon gets
# the host's name in its own UTS namespace; munged listens on a private socket; ports are per
# cluster name, so several clusters can run at once.
set -euo pipefail
cd "$(dirname "$0")/.."
prog=slurm-cluster.sh
die() { echo "$prog: $*" >&2; exit 1; }

cmd=${1:-}
case "$cmd" in
  up) K=${2:?usage: $prog up K [NAME]}; NAME=${3:-nrs} ;;
  down) NAME=${2:-nrs} ;;
  *) echo "usage: $prog up K [NAME] | down [NAME]" >&2; exit 2 ;;
esac
BASE=${NRUN_CLUSTER_DIR:-/tmp/nrun-cluster}
STATE="$BASE/$NAME"
SL="$STATE/slurm"
sum=$(printf '%s' "$NAME" | cksum | cut -d' ' -f1)
NET=$((sum % 200 + 20))
PREFIX="10.213.$NET"
CTL_PORT=$((20000 + NET * 4))
D_PORT=$((CTL_PORT + 1))

stop_daemons() {
  local f p
  for f in "$SL"/*.pid; do
    [ -e "$f" ] || continue
    p=$(cat "$f" 2>/dev/null || true)
    [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  sleep 0.2
  for f in "$SL"/*.pid; do
    [ -e "$f" ] || continue
    p=$(cat "$f" 2>/dev/null || true)
    [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true
  done
  # Steps' processes (slurmstepd) of this cluster, found by its config path.
  pkill -9 -f "slurmstepd.*$SL" 2>/dev/null || true
}

if [ "$cmd" = down ]; then
  [ -d "$SL" ] && stop_daemons
  rm -rf "$SL"
  bash scripts/netns-cluster.sh down "$NAME"
  exit 0
fi

[ "$(id -u)" = 0 ] || die "must run as root"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "$prog: installing slurm-wlm and munge" >&2
  # The packages' own daemons must not start (no systemd here; ours are private).
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends slurm-wlm munge) >/dev/null || { rm -f /usr/sbin/policy-rc.d; die "apt-get install slurm-wlm munge failed"; }
  rm -f /usr/sbin/policy-rc.d
fi

[ -d "$SL" ] && stop_daemons
bash scripts/netns-cluster.sh up "$K" "$NAME" >/dev/null
mkdir -p "$SL/state" "$SL/munge"
chmod 755 "$SL" "$SL/munge"

# munge: one private daemon; its socket is a file, reachable from every namespace.
dd if=/dev/urandom of="$SL/munge.key" bs=1024 count=1 status=none
chmod 600 "$SL/munge.key"
munged --socket="$SL/munge/munge.sock" --key-file="$SL/munge.key" --pid-file="$SL/munged.pid" \
  --log-file="$SL/munged.log" --seed-file="$SL/munged.seed" --force ||
  die "munged did not start (see $SL/munged.log)"
munge -n -S "$SL/munge/munge.sock" | unmunge -S "$SL/munge/munge.sock" >/dev/null ||
  die "munge does not work (see $SL/munged.log)"

nodes=""
for i in $(seq 1 "$K"); do
  mkdir -p "$SL/spool/$NAME-h$i"
  nodes+="NodeName=$NAME-h$i NodeAddr=$PREFIX.$((10 + i)) NodeHostname=$NAME-h$i CPUs=2 State=UNKNOWN"$'\n'
done
cat >"$SL/slurm.conf" <<EOF
# Written by nrun's $prog for cluster $NAME.
ClusterName=$NAME
SlurmctldHost=$NAME-ctl($PREFIX.1)
SlurmctldPort=$CTL_PORT
SlurmdPort=$D_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SL/munge/munge.sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=batch_sched_delay=0
KillWait=5
StateSaveLocation=$SL/state
SlurmdSpoolDir=$SL/spool/%n
SlurmctldPidFile=$SL/slurmctld.pid
SlurmdPidFile=$SL/slurmd.%n.pid
SlurmctldLogFile=$SL/slurmctld.log
SlurmdLogFile=$SL/slurmd.%n.log
$nodes
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$SL/slurm.conf"

# The controller in the root namespace (it answers on the bridge), under its own name.
unshare --uts sh -c 'hostname "$1" && shift && exec "$@"' sh "$NAME-ctl" \
  slurmctld -f "$SLURM_CONF" -i || die "slurmctld did not start (see $SL/slurmctld.log)"
for i in $(seq 1 "$K"); do
  nsenter --net="/run/netns/$NAME-h$i" unshare --uts sh -c 'hostname "$1" && shift && exec "$@"' \
    sh "$NAME-h$i" slurmd -f "$SLURM_CONF" -N "$NAME-h$i" ||
    die "slurmd of $NAME-h$i did not start (see $SL/slurmd.$NAME-h$i.log)"
done

# Ready when every node is idle.
idle=0
for _ in $(seq 1 100); do
  idle=$(sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle' || true)
  [ "$idle" = "$K" ] && break
  sleep 0.1
done
[ "$idle" = "$K" ] || die "only $idle of $K nodes are idle: $(sinfo -N 2>&1 | tr '\n' ' ')"
echo "export SLURM_CONF=$SLURM_CONF" >"$SL/slurm.env"
echo "$prog: cluster $NAME: $K slurmd nodes ($NAME-h[1-$K]), slurmctld on $PREFIX.1:$CTL_PORT" >&2
echo "$SL/slurm.env"

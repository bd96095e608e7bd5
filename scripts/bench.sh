#!/usr/bin/env bash
# Benchmarks nrun against its peers, in the same run, on this machine:
#  1. launch overhead: nrun vs torchrun vs Open MPI's mpirun, 8 copies of `true`
#  2. the store: nrun's vs PyTorch's own TCPStore server (libuv and legacy backends):
#     round trip, a burst of N processes connecting at once, a rendezvous of N clients, a burst of
#     N real torch clients connecting at once
# Raw results go to bench-results/<time>.jsonl; a markdown summary is printed at the end.
#   RUNS=10 scripts/bench.sh        (RUNS: repetitions of the fast cases; medians reported)
#   NRUN_BASE=/path/to/older/nrun scripts/bench.sh   also measures that nrun beside this one
#                                   (launch and cluster sections), so a regression shows in one run
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-10}
SLOW_RUNS=${SLOW_RUNS:-5}

cargo build --release --quiet
cargo build --release --quiet --example storebench
venv=$(scripts/venv.sh)
PY=$venv/bin/python
if ! command -v mpirun >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null
fi
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
mkdir -p bench-results
out=bench-results/$(date -u +%Y%m%dT%H%M%SZ).jsonl
tgt=${CARGO_TARGET_DIR:-target}
NRUN=$tgt/release/nrun
SB=$tgt/release/examples/storebench
measure() { python3 scripts/bench/measure.py "$@" | tee -a "$out"; }
export NCCL_NVLS_ENABLE=0

{
  echo "{\"meta\": {\"date\": \"$(date -u +%FT%TZ)\", \"host\": \"$(hostname)\", \"cpus\": $(nproc),"
  echo "  \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\","
  echo "  \"mem_gib\": $(awk '/MemTotal/ {printf "%.0f", $2/1048576}' /proc/meminfo), \"kernel\": \"$(uname -r)\","
  echo "  \"nrun\": \"$($NRUN --version)\", \"torch\": \"$($PY -c 'import torch; print(torch.__version__)')\","
  echo "  \"mpirun\": \"$(mpirun --version 2>&1 | head -1)\"}}"
} | tr -d '\n' >> "$out"; echo >> "$out"

# BENCH_ONLY=local|store|cluster|bisect|slurm|watch runs one section; BENCH_ONLY=torchburst runs
# only the store section's bursts of real torch clients.
only() { [ -z "${BENCH_ONLY:-}" ] || [ "$BENCH_ONLY" = "$1" ]; }

if only local; then
echo "== launch overhead: 8 copies of true" >&2
measure launch/nrun "$RUNS" -- $NRUN --nproc 8 --no-python true
if [ -n "${NRUN_BASE:-}" ]; then
  measure launch/nrun-base "$RUNS" -- "$NRUN_BASE" --nproc 8 --no-python true
fi
measure launch/mpirun "$RUNS" -- mpirun --allow-run-as-root --oversubscribe -np 8 true
measure launch/torchrun "$SLOW_RUNS" -- "$venv/bin/torchrun" --nproc-per-node 8 --no-python true

fi

if only store || only torchburst; then
echo "== store" >&2
# One labelled storebench run; a run past its time limit is recorded as such.
sb() {
  local label=$1 limit=$2; shift 2
  local r
  if r=$(timeout "$limit" $SB "$@"); then
    echo "{\"label\": \"$label\", \"result\": $r}" | tee -a "$out"
  else
    echo "{\"label\": \"$label\", \"timed_out_after_s\": $limit}" | tee -a "$out"
  fi
}
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
$NRUN --master-port "$port" --no-python sleep 7200 2>/dev/null &
nrun_pid=$!
servers=("nrun $port")
cleanup() { kill "$nrun_pid" 2>/dev/null || true; for p in "${torch_pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; }
torch_pids=()
trap cleanup EXIT
for be in libuv legacy; do
  exec {fd}< <("$PY" scripts/bench/torch_store_server.py "$be"; echo)
  read -r -u "$fd" tport
  torch_pids+=("$(pgrep -n -f "torch_store_server.py $be")")
  servers+=("torch-$be $tport")
done
sleep 0.5
if only store; then
dst=1  # each rendezvous run connects to another 127.0.0.x, so TIME_WAIT ports of one run do not slow the next
for s in "${servers[@]}"; do
  read -r name p <<<"$s"
  slow=$([ "$name" = nrun ] && echo no || echo yes)
  for _ in $(seq "$SLOW_RUNS"); do sb "rtt/$name" 120 rtt "127.0.0.1:$p" 20000; done
  for _ in $(seq "$SLOW_RUNS"); do sb "burst100/$name" 120 burst "127.0.0.1:$p" 100; done
  if [ "$slow" = no ]; then
    for _ in $(seq "$SLOW_RUNS"); do sb "burst1000/$name" 120 burst "127.0.0.1:$p" 1000; done
    for n in 1000 4000 16000; do
      for _ in $(seq "$SLOW_RUNS"); do dst=$((dst % 250 + 1)); sb "rendezvous$n/$name" 120 rendezvous "127.0.0.$dst:$p" "$n"; done
    done
  else
    # PyTorch's server needs seconds per 100 connections: one run each, with a time limit.
    sb "burst1000/$name" 120 burst "127.0.0.1:$p" 1000
    dst=$((dst % 250 + 1)); sb "rendezvous1000/$name" 180 rendezvous "127.0.0.$dst:$p" 1000
    for n in 4000 16000; do dst=$((dst % 250 + 1)); sb "rendezvous$n/$name" 60 rendezvous "127.0.0.$dst:$p" "$n"; done
  fi
done
fi
# N real torch clients released at once (tests/python/torch_burst.py), each server in turn per
# round: first as this host's resolver has them (each torch client asks DNS for the store's name
# before it connects: BENCHMARKS.md, section 13), then, where a private mount namespace can be
# made, with that name in /etc/hosts, which leaves what the store's accept path itself costs.
TORCH_BURST=${TORCH_BURST:-300}
hosts_ptr=$(mktemp)
{ cat /etc/hosts; printf '127.0.0.1 localhost\n::ffff:127.0.0.1 localhost\n::1 localhost\n'; } >"$hosts_ptr"
if [ "$(id -u)" = 0 ]; then ns=(unshare -m); else ns=(unshare -r -m); fi
"${ns[@]}" mount --bind /etc/hosts /etc/hosts 2>/dev/null || { ns=(); echo "no mount namespace: torch bursts with DNS only" >&2; }
tb() {
  local label=$1 p=$2; shift 2
  local r
  if r=$(timeout 180 "$@" "$PY" tests/python/torch_burst.py 127.0.0.1 "$p" "$TORCH_BURST" 2>/dev/null | tail -1) && [ -n "$r" ]; then
    echo "{\"label\": \"$label\", \"result\": $r}" | tee -a "$out"
  else
    echo "{\"label\": \"$label\", \"timed_out_after_s\": 180}" | tee -a "$out"
  fi
}
for round in $(seq "$SLOW_RUNS"); do
  for s in "${servers[@]}"; do
    read -r name p <<<"$s"
    # PyTorch's servers take tens of seconds per burst (they too ask DNS, once per accept): 3 rounds.
    [ "$name" != nrun ] && [ "$round" -gt 3 ] && continue
    tb "torchburst$TORCH_BURST/$name" "$p"
    if [ ${#ns[@]} -gt 0 ]; then
      tb "torchburst$TORCH_BURST-localptr/$name" "$p" "${ns[@]}" sh -c 'mount --bind "$1" /etc/hosts && shift && exec "$@"' sh "$hosts_ptr"
    fi
  done
done
rm -f "$hosts_ptr"
fi

if only cluster; then
echo "== multi-node launch over ssh (namespace hosts)" >&2
# K hosts of scripts/netns-cluster.sh, the same sshds for both launchers; 2 workers per host.
for K in ${CLUSTER_SIZES:-2 4 8}; do
  cfg=$(bash scripts/netns-cluster.sh up "$K" nbench | tail -1)
  hosts=$(paste -sd, "$(dirname "$cfg")/hosts")
  net=$(grep NRUN_CLUSTER_SUBNET "$(dirname "$cfg")/cluster.env" | cut -d= -f2)
  measure "cluster$K/nrun" "$SLOW_RUNS" --timeout 60 -- $NRUN -H "$hosts" --ssh-opts "-F $cfg" --nproc 2 --no-python true
  if [ -n "${NRUN_BASE:-}" ]; then
    measure "cluster$K/nrun-base" "$SLOW_RUNS" --timeout 60 -- "$NRUN_BASE" -H "$hosts" --ssh-opts "-F $cfg" --nproc 2 \
      --remote-nrun "$NRUN_BASE" --no-python true
  fi
  mpi_hosts=$(sed 's/$/:2/' "$(dirname "$cfg")/hosts" | paste -sd,)
  measure "cluster$K/mpirun" "$SLOW_RUNS" --timeout 60 -- mpirun --allow-run-as-root --oversubscribe -H "$mpi_hosts" -np $((K * 2)) \
    --mca plm_rsh_agent ssh --mca plm_rsh_args "-F $cfg" --mca oob_tcp_if_include "$net" --mca btl_tcp_if_include "$net" true
  bash scripts/netns-cluster.sh down nbench >/dev/null
done
fi

if only bisect; then
echo "== bisect: one bad node (high ports blocked) among N" >&2
for N in ${BISECT_SIZES:-4 8 16}; do
  cfg=$(bash scripts/netns-cluster.sh up "$N" nbis | tail -1)
  dir=$(dirname "$cfg")
  bad=$((N / 2 + 1))
  ip netns exec "nbis-h$bad" sh -c "iptables -A INPUT -i eth0 -p tcp --dport 22 -j ACCEPT && iptables -A INPUT -i eth0 -p tcp -m state --state NEW -j DROP"
  t0=$(date +%s%N)
  set +e
  $NRUN bisect --hostfile "$dir/hosts" --ssh-opts "-F $cfg" --probe net --nproc 2 --preflight-sizes 8:1M:4 --iters 3 \
    --preflight-timeout 5 --slow-factor 0.3 --no-python-probe --report "$dir/report.json" >/dev/null 2>&1
  code=$?
  set -e
  t1=$(date +%s%N)
  python3 - "$dir/report.json" "$N" "$bad" "$code" "$(( (t1 - t0) / 1000000 ))" <<'PY' | tee -a "$out"
import json, sys
r = json.load(open(sys.argv[1])); n, bad, code, ms = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
named = [x["host"] for x in r["nodes"] if x["verdict"] != "good"]
print(json.dumps({"label": f"bisect{n}", "exit_code": code, "wall_ms": ms, "rounds": len(r["rounds"]),
                  "rounds_after_stage1": r["rounds_after_stage1"], "named": named, "expected": f"nbis-h{bad}"}))
PY
  bash scripts/netns-cluster.sh down nbis >/dev/null
done
fi

if only slurm; then
echo "== launch inside a Slurm allocation of 3 nodes (real slurmctld/slurmd in namespaces)" >&2
# Measured inside one allocation, so salloc's own cost is not counted; srun alone is the peer.
env_file=$(bash scripts/slurm-cluster.sh up 3 nslb | tail -1)
# shellcheck disable=SC1090
. "$env_file"
salloc -N3 --ntasks-per-node=2 -Q python3 scripts/bench/measure.py slurm3/nrun "$RUNS" -- $NRUN --nproc 2 --no-python-probe --no-python true | tee -a "$out"
if [ -n "${NRUN_BASE:-}" ]; then
  salloc -N3 --ntasks-per-node=2 -Q python3 scripts/bench/measure.py slurm3/nrun-base "$RUNS" -- "$NRUN_BASE" --nproc 2 --no-python-probe --no-python true | tee -a "$out"
fi
salloc -N3 --ntasks-per-node=2 -Q python3 scripts/bench/measure.py slurm3/srun "$RUNS" -- srun --ntasks-per-node=2 true | tee -a "$out"
salloc -N3 --ntasks-per-node=2 -Q python3 scripts/bench/measure.py slurm3/srun-nrun "$RUNS" -- srun -n3 --ntasks-per-node=1 $NRUN --nproc 2 --no-python-probe --no-python true | tee -a "$out"
bash scripts/slurm-cluster.sh down nslb >/dev/null
fi

if only watch; then
echo "== the watch: overhead on an 8-rank gloo loop, time from a stall to its diagnosis" >&2
python3 scripts/bench/watch_bench.py "$NRUN" "$PY" "$SLOW_RUNS" | tee -a "$out"
# The step as a distribution (mean, p90, p99, max beside the median): nrun with the watch on and
# off and torchrun, alternating (gloo on the CPU here; NCCL where a GPU is: issue 44).
echo "== step-time distributions: nrun watch on/off, torchrun (scripts/bench/watch_tail.sh)" >&2
TAIL_JSON=1 PYTHON="$PY" NRUN="$NRUN" ROUNDS="$SLOW_RUNS" MODE=compare scripts/bench/watch_tail.sh | tee -a "$out"
fi

echo "results: $out" >&2
python3 scripts/bench/summarize.py "$out"

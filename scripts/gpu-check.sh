#!/usr/bin/env bash
# The GPU half of the preflight's and the watch's tests, and the preflight's validation against
# torch, for a machine with one NVIDIA GPU or more (nrun built elsewhere: pass NRUN=path).
# Writes logs to $OUT (or ./gpu-check-out). GPU_CHECK=preflight, watch or faults runs one part.
#   NRUN=target/release/nrun PYTHON=/opt/torch/.venv/bin/python3 scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
NRUN=${NRUN:-target/release/nrun}
PY=${PYTHON:-python3}
OUTDIR=${OUT:-gpu-check-out}
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0   # must reach every process on the shared GPU machines
NGPU=$(ls /proc/driver/nvidia/gpus 2>/dev/null | wc -l)
MAX=${MAX_SIZE:-2G}
pass=0; fail=0
check() {  # check NAME EXPECTED_RC CMD... : runs CMD, compares its exit code, keeps its output
  local name=$1 want=$2; shift 2
  local t0=$(date +%s%N)
  "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$? t1=$(date +%s%N)
  printf '%-34s rc=%-3s want=%-3s %6d ms  ' "$name" "$rc" "$want" "$(( (t1 - t0) / 1000000 ))"
  if [ "$rc" = "$want" ]; then pass=$((pass+1)); echo ok; else fail=$((fail+1)); echo FAILED; tail -20 "$OUTDIR/$name.log"; fi
}
echo "GPUs: $NGPU; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
[ "$NGPU" -ge 1 ] || { echo "no GPU: nothing to check"; exit 0; }
NP=$([ "$NGPU" -ge 2 ] && echo "$NGPU" || echo 1)
SECTION=${GPU_CHECK:-all}
if [ "$SECTION" = all ] || [ "$SECTION" = preflight ]; then

# Validation: default sweep, whole command timed (target <= 1.5 s), then the full sweep beside torch.
check preflight-default 0 "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --report "$OUTDIR/preflight-default.json"
check preflight-one-gpu 0 "$NRUN" --preflight-only --nproc 1 --python "$PY"
check preflight-full 0 "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --preflight-sizes "8:$MAX:2" --report "$OUTDIR/preflight-full.json"
maxb=$(python3 -c "import sys; s='$MAX'; m={'K':1<<10,'M':1<<20,'G':1<<30}; print(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s))")
check torch-allreduce 0 "$NRUN" --no-preflight --nproc "$NP" --python "$PY" scripts/bench/torch_allreduce.py 8 "$maxb" 2 20 5
# Faults, each ending in a diagnosis within the timeout and nothing left running.
check wrong-nccl-lib 90 "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --nccl-lib /lib/x86_64-linux-gnu/libc.so.6
check missing-nccl-lib 2 "$NRUN" --preflight-only --nproc "$NP" --nccl-lib /nonexistent/libnccl.so.2
check missing-ifname-loopback 91 env NCCL_SOCKET_IFNAME==nosuch0 "$NRUN" --preflight-only --preflight-loopback --preflight-timeout 20 --nproc "$NP" --python "$PY"
if [ -e /lib/x86_64-linux-gnu/libnccl.so.2 ]; then
  check system-nccl 0 "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --nccl-lib /lib/x86_64-linux-gnu/libnccl.so.2
fi
# A rank killed while the preflight runs: the supervisor names it, the rest are stopped.
( sleep 0.4; pkill -9 -n -f '__preflight' ) &
check rank-killed 90 "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --preflight-sizes 8:2G:2
wait
check min-busbw-too-high 94 "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --min-busbw 100000
check preflight-net 0 "$NRUN" --preflight-only --preflight net --nproc "$NP"
# The same preflight with the node's agent as a process (a host list naming this host), and
# --include HOST:SLOT pinning that GPU (CUDA_VISIBLE_DEVICES) for the preflight and the job.
check local-agent-preflight 0 "$NRUN" -H localhost --preflight-only --nproc "$NP" --python "$PY"
if [ "$NGPU" -ge 2 ]; then
  check include-slot-preflight 0 "$NRUN" -H "localhost:$NGPU" --include localhost:1 --preflight-only --python "$PY" --report "$OUTDIR/include-slot.json"
  check include-slot-job 0 "$NRUN" -H "localhost:$NGPU" --include localhost:1 --no-preflight --no-python sh -c 'test "$CUDA_VISIBLE_DEVICES" = 1 && echo "rank $RANK sees GPU $CUDA_VISIBLE_DEVICES"'
fi
# The preflight against the hardware: the line rate shown, each degradation slow (94) with its
# cause named, a forced algorithm that is not slower still ok.
check hw-healthy 0 "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --report "$OUTDIR/hw-healthy.json"
# The line rate and the degradations need a link between GPUs (NVLink): two GPUs or more.
if [ "$NGPU" -ge 2 ]; then
  check hw-healthy-line-rate 0 grep -q "line rate: NVLink" "$OUTDIR/hw-healthy.log"
  for c in "NCCL_P2P_DISABLE=1" "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" "NCCL_MAX_NCHANNELS=1" \
           "NCCL_MIN_NCHANNELS=1 NCCL_MAX_NCHANNELS=2" "NCCL_P2P_LEVEL=LOC" "NCCL_BUFFSIZE=65536"; do
    name=hw-$(echo "$c" | tr ' =' '_-' | tr 'A-Z' 'a-z')
    check "$name" 94 env $c "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --preflight-sizes 8:1G:2
    check "$name-cause" 0 grep -q "hint: set here and changing NCCL's path:.*${c%% *}" "$OUTDIR/$name.log"
  done
fi
check hw-tree-simple 0 env NCCL_PROTO=Simple NCCL_ALGO=Tree "$NRUN" --preflight-only --nproc "$NP" --python "$PY" --preflight-sizes 8:1G:2
check train-with-preflight 0 "$NRUN" --nproc "$NP" --python "$PY" examples/train.py --steps 20
check hw-health-line 0 grep -q "GPU health: .* GPU(s) ok" "$OUTDIR/hw-healthy.log"
# torchrun's flags on GPUs: each worker bound to its GPU's CPUs; one GPU each as local rank 0.
check numa-binding 0 "$NRUN" --nproc "$NP" --numa-binding node --no-preflight --no-python sh -c 'grep Cpus_allowed_list /proc/self/status'
check numa-binding-bound 1 grep -q "not bound" "$OUTDIR/numa-binding.log"
cat > "$OUTDIR/vlr.py" <<'PY'
import os, torch
assert torch.cuda.device_count() == 1 and os.environ["LOCAL_RANK"] == "0"
print("rank", os.environ["RANK"], "GPU", os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.get_device_name(0))
PY
check virtual-local-rank 0 "$NRUN" --nproc "$NP" --virtual-local-rank --no-preflight --python "$PY" "$OUTDIR/vlr.py"
# c10d: the same command twice on this machine, one GPU each, as two nodes: the NCCL preflight
# spans both.
if [ "$NGPU" -ge 2 ]; then
  C10D="--nnodes 2 --nproc 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29671 --rdzv-id gpucheck --preflight-only --python $PY"
  ( CUDA_VISIBLE_DEVICES=1 "$NRUN" $C10D > "$OUTDIR/c10d-first.out" 2>&1; echo "rc=$?" >> "$OUTDIR/c10d-first.out" ) &
  check c10d-preflight 0 env CUDA_VISIBLE_DEVICES=0 "$NRUN" $C10D
  wait
  check c10d-first 0 grep -q "rc=0" "$OUTDIR/c10d-first.out"
fi
fi  # preflight section

if [ "$SECTION" = all ] || [ "$SECTION" = watch ]; then
# The watch on NCCL, with any number of GPUs: two ranks share GPU 0 as two NCCL "hosts" (their
# own NCCL_HOSTID), so NCCL connects them over NET/Socket as it would two nodes. Launched through
# a shell wrapper that execs python, which the watch follows by default.
W2=(--nproc 2 --no-preflight --no-python sh -c 'NCCL_HOSTID=h$RANK exec "$0" "$@"' "$PY")
T="timeout -k 5 120"  # a case that goes wrong costs two minutes, not the machine
stamped() {  # stamped CMD...: CMD's output, each line after its arrival time (s since epoch)
  bash -c 'set -o pipefail; "$@" 2>&1 | while IFS= read -r l; do echo "$(date +%s.%N) $l"; done' _ "$@"
}
since() {  # since LOG PATTERN-FROM PATTERN-TO: seconds between the first lines matching each
  awk -v a="$2" -v b="$3" '$0 ~ a && !x {x=$1} $0 ~ b && !y {y=$1} END {if (x && y) printf "%.1f", y-x; else print "?"}' "$1"
}
# Rank 1 sleeps before the 6th all_reduce; rank 0 waits at its next sync. The flight recorder
# names the collective.
check nccl-hang 97 stamped $T env NRUN_HANG_CASE=sleep NRUN_HANG_BACKEND=nccl "$NRUN" --hang-timeout 10 --on-hang stop --report "$OUTDIR/nccl-hang.json" "${W2[@]}" tests/python/hang.py
check nccl-hang-named 0 grep -Eq "rank 0 waits in all_reduce #[0-9]+ \(4 KiB\); rank 1 completed #[0-9]+ and is in stuck_forever" "$OUTDIR/nccl-hang.log"
# NCCL's RAS (2.24+) asked during the stall: its account printed with the hang and in the report.
check nccl-hang-ras 0 grep -q "different AllReduce operation counts" "$OUTDIR/nccl-hang.log"
check nccl-hang-ras-report 0 "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); h = r["watch"]["hangs"][0]["nccl_ras"]; assert "Rank 1 has launched up to operation 5" in h["status"], h' "$OUTDIR/nccl-hang.json"
echo "  hang named $(since "$OUTDIR/nccl-hang.log" 'stalled at' 'nrun: hang:') s after the stall (--hang-timeout 10)"
# From the 6th all_reduce on, rank 1 reduces 4x as many elements (60 steps: a run that does not
# hang ends).
check nccl-size 97 stamped $T env NRUN_HANG_CASE=size NRUN_STEPS=60 NRUN_HANG_BACKEND=nccl "$NRUN" --hang-timeout 10 --on-hang stop "${W2[@]}" tests/python/hang.py
check nccl-size-named 0 grep -Eq "disagree on collective #6: rank 0 all_reduce \(4 KiB\), rank 1 all_reduce \(16 KiB\)" "$OUTDIR/nccl-size.log"
echo "  mismatch named $(since "$OUTDIR/nccl-size.log" '.' 'collective mismatch') s after the job's first line"
# Rank 1 does 3x the matrix work of rank 0 each step: named within a minute, with each rank's
# wait; the same job balanced names nobody; the watch's cost beside --watch off. Both ranks wait
# at the same .item(), so only their time inside the collectives on the GPU tells them apart,
# counted by nrun's NCCL profiler plugin (free). With a plugin of the user's own
# (NCCL_PROFILER_PLUGIN=none here) nrun installs none and the job runs as before; a GPU
# straggler is then named only from flight-recorder dumps asked by NRUN_WATCH_FR_PERIOD, and
# only while torch writes them within the watch's budget (on an H100 it took 6.6 s, and the
# watch stopped asking: BENCHMARKS.md section 33), so that run checks the job alone.
check nccl-straggler 0 stamped $T env NRUN_MM=6 NRUN_SLOW_MM=18 NRUN_SECONDS=45 "$NRUN" --report "$OUTDIR/nccl-straggler.json" "${W2[@]}" tests/python/gpu_steps.py
check nccl-straggler-named 0 grep -q "rank 1 on .* is a straggler" "$OUTDIR/nccl-straggler.log"
echo "  straggler named $(since "$OUTDIR/nccl-straggler.log" '.' 'is a straggler') s after the job's first line"
check nccl-straggler-own-plugin 0 stamped $T env NCCL_PROFILER_PLUGIN=none NRUN_WATCH_FR_PERIOD=15 NRUN_MM=6 NRUN_SLOW_MM=18 NRUN_SECONDS=45 "$NRUN" "${W2[@]}" tests/python/gpu_steps.py
# BALANCED_S=300: the issue's five-minute run (default 40 s, to keep the check short).
BALANCED_S=${BALANCED_S:-40}
check nccl-balanced 0 stamped timeout -k 5 $((BALANCED_S + 80)) env NRUN_MM=6 NRUN_SECONDS=$BALANCED_S "$NRUN" --report "$OUTDIR/nccl-balanced.json" "${W2[@]}" tests/python/gpu_steps.py
check nccl-balanced-none 1 grep -q "straggler" "$OUTDIR/nccl-balanced.log"
check nccl-balanced-report 0 "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); assert r["watch"]["stragglers"] == [] and r["watch"]["hangs"] == [], r["watch"]' "$OUTDIR/nccl-balanced.json"
check nccl-watch-off 0 $T env NRUN_MM=6 NRUN_SECONDS=25 "$NRUN" --watch off "${W2[@]}" tests/python/gpu_steps.py
echo "  step time, watch on (flight recorder on) vs off: $(grep -ho 'median step .* ms' "$OUTDIR/nccl-balanced.log" | tr '\n' ' ')vs $(grep -ho 'median step .* ms' "$OUTDIR/nccl-watch-off.log" | tr '\n' ' ')"
fi  # watch section

if [ "$SECTION" = all ] || [ "$SECTION" = faults ]; then
# The fault model on NCCL (README "Fault model"): a rank killed by SIGKILL mid-training (the
# OOM killer's signal) is a suspicion, and the group restarts in place, as torchrun would; every
# rank's second attempt says TORCHELASTIC_RESTART_COUNT 1. Two ranks share GPU 0 as two hosts.
W2=(--nproc 2 --no-preflight --no-python sh -c 'NCCL_HOSTID=h$RANK exec "$0" "$@"' "$PY")
cat > "$OUTDIR/killed.py" <<'PY'
import os, signal, torch, torch.distributed as dist
dist.init_process_group("nccl")
rank, again = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
torch.cuda.set_device(0)
t = torch.ones(1 << 20, device="cuda")
for step in range(20):
    if step == 5 and rank == 1 and again == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
torch.cuda.synchronize()
print(f"rank {rank} done, restart count {again}", flush=True)
dist.destroy_process_group()
PY
check nccl-sigkill-restarts 0 timeout -k 5 180 "$NRUN" --max-restarts 1 --report "$OUTDIR/nccl-sigkill.json" "${W2[@]}" "$OUTDIR/killed.py"
check nccl-sigkill-suspected 0 grep -q "node suspected (rank 1 was killed by SIGKILL" "$OUTDIR/nccl-sigkill-restarts.log"
check nccl-sigkill-rank0 0 grep -q "rank 0 done, restart count 1" "$OUTDIR/nccl-sigkill-restarts.log"
check nccl-sigkill-rank1 0 grep -q "rank 1 done, restart count 1" "$OUTDIR/nccl-sigkill-restarts.log"
# A rank that polls in Python instead of entering the all_reduce its peer waits in: the hang's
# culprit within --hang-timeout and a few seconds, exit 97.
check nccl-poll 97 timeout -k 5 120 env NRUN_HANG_CASE=poll NRUN_HANG_BACKEND=nccl "$NRUN" --hang-timeout 10 --on-hang stop --report "$OUTDIR/nccl-poll.json" "${W2[@]}" tests/python/hang.py
check nccl-poll-culprit 0 "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); h = r["watch"]["hangs"][0]; assert h["culprits"] == [1], h' "$OUTDIR/nccl-poll.json"
fi  # faults section

# The pattern also matches the shells that started this script when their command line names one
# of these files (a caller's own follow-up check, say): count only processes outside that chain.
ancestors=" $$ "; p=$$
while p=$(ps -o ppid= -p "$p" 2>/dev/null | tr -d ' ') && [ -n "$p" ] && [ "$p" != 0 ]; do ancestors+="$p "; done
leftover=0
for p in $(pgrep -f '__preflight|examples/train.py|hang.py|gpu_steps.py|killed.py'); do
  case "$ancestors" in *" $p "*) ;; *) leftover=$((leftover+1)); ps -o pid=,args= -p "$p" ;; esac
done
echo "left running: $leftover"
[ "$leftover" = 0 ] || fail=$((fail+1))
for f in "$OUTDIR"/*.log; do
  echo "--- $(basename "$f" .log): $(grep -E '^preflight |communicator init:|time per phase|problem:|line rate:|NCCL path:|hint: set here|conclusion:|straggler|median step' "$f" | tr '\n' '|' | cut -c1-600)"
done
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]

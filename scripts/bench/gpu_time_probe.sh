#!/usr/bin/env bash
# Probe of nrun's NCCL profiler plugin (crates/agent/nccl/profiler.c) on the GPU machine, before
# the watch uses it: (1) does NCCL load it and do the counters tell a GPU straggler apart;
# (2) what does it cost the issue's 10 ms step (torchrun alone vs torchrun with the plugin).
#   SO=path/libnccl-profiler-nrun.so PYTHON=python3 ROUNDS=3 scripts/bench/gpu_time_probe.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
SO=$(realpath "${SO:?path of the plugin}")
export NCCL_NVLS_ENABLE=0
P=$(mktemp -d /tmp/prof-XXXX)
cat > $P/mk.py <<'PYEOF'
import struct, sys
for p in sys.argv[1:]:
    with open(p, "wb") as f:
        f.write(struct.pack("<QI", 0x3146525052554e4e, 0).ljust(64, b"\0") + b"\0" * (16 * 64))
PYEOF
mk() { "$PY" $P/mk.py "$@"; }
read_all() { "$PY" - "$@" <<'PYEOF'
import struct, sys, time
for p in sys.argv[1:]:
    b = open(p, "rb").read()
    n = struct.unpack_from("<I", b, 8)[0]
    out = []
    for i in range(min(n, 16)):
        comm, rank, nranks, colls, ns, ready = struct.unpack_from("<QiiQQI", b, 64 + 64 * i)
        out.append(f"comm {comm:x} rank {rank}/{nranks} colls {colls} kernel {ns/1e6:.1f} ms")
    print(f"{time.time():.2f} {p}: slots {n}: " + "; ".join(out), flush=True)
PYEOF
}
cat > $P/wrap.sh <<WEOF
#!/bin/sh
NCCL_HOSTID=h\$RANK NRUN_NCCL_PROFILE=$P/rank\$RANK exec "\$@"
WEOF
chmod +x $P/wrap.sh
echo "== 1. straggler (rank 1: 18 matmuls, rank 0: 6), the plugin's counters each 2 s"
mk $P/rank0 $P/rank1
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV NCCL_PROFILER_PLUGIN=$SO NRUN_MM=6 NRUN_SLOW_MM=18 NRUN_SECONDS=16 \
  "$PY" -m torch.distributed.run --nproc-per-node 2 --no-python $P/wrap.sh "$PY" tests/python/gpu_steps.py \
  > $P/straggler.log 2>&1 &
pid=$!
for i in $(seq 1 12); do sleep 2; read_all $P/rank0 $P/rank1; done
wait $pid; echo "exit $?"
grep -i "profiler\|rank .: .* steps" $P/straggler.log | sort | uniq -c | head -20
echo "== 1b. balanced (6 and 6)"
mk $P/rank0 $P/rank1
NCCL_PROFILER_PLUGIN=$SO NRUN_MM=6 NRUN_SLOW_MM=6 NRUN_SECONDS=10 \
  "$PY" -m torch.distributed.run --nproc-per-node 2 --no-python $P/wrap.sh "$PY" tests/python/gpu_steps.py \
  > $P/balanced.log 2>&1 &
pid=$!
for i in $(seq 1 6); do sleep 2; read_all $P/rank0 $P/rank1; done
wait $pid; echo "exit $?"; grep "steps" $P/balanced.log
[ "${COST:-1}" = 1 ] || exit 0
echo "== 2. cost: the issue's step, torchrun with and without the plugin"
W="--no-python $P/wrap.sh $PY scripts/bench/tail_worker.py"
TR="$PY -m torch.distributed.run --nproc-per-node ${NPROC:-2}"
MK="$PY $P/mk.py $(seq -f "$P/rank%g" 0 7 | tr '\n' ' ')"
python3 scripts/bench/step_tail.py "${ROUNDS:-3}" "torchrun=$TR $W" "torchrun-plugin=$MK && NCCL_PROFILER_PLUGIN=$SO $TR $W"
read_all $P/rank0 $P/rank1

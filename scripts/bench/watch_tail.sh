#!/usr/bin/env bash
# The watch's cost on a GPU step, as a distribution (issue 44; docs/watch.md, "What the watch
# costs"): tail_worker.py's step (4 matmuls of 2048x2048, an all-reduce of 16 MiB) on NPROC ranks
# sharing GPU 0, under torchrun, nrun --watch off and nrun's watch, alternating, ROUNDS rounds.
#   MODE=cause   each look of the watch turned off alone, and the looks laid beside the slow steps
#   MODE=compare the watch on and off, torchrun, and OLD (a previous nrun binary) if given
#   NRUN=target/release/nrun OLD=path PYTHON=python3 ROUNDS=3 NPROC=2 scripts/bench/watch_tail.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
NRUN=${NRUN:-target/release/nrun}
PY=${PYTHON:-python3}
ROUNDS=${ROUNDS:-3}
NPROC=${NPROC:-2}
export NCCL_NVLS_ENABLE=0  # must reach every process on the shared GPU machines
W="--no-python scripts/bench/hostid.sh $PY scripts/bench/tail_worker.py"
NR="$NRUN --nproc $NPROC --no-preflight"
TR="$PY -m torch.distributed.run --nproc-per-node $NPROC --no-python scripts/bench/hostid.sh $PY scripts/bench/tail_worker.py"
case ${MODE:-compare} in
cause)
  python3 scripts/bench/step_tail.py "$ROUNDS" "watch-off=$NR --watch off $W" "torchrun=$TR" \
    "watch-on=NRUN_WATCH_TRACE=\$TAIL_DIR/trace $NR $W" \
    "no-locals=NRUN_WATCH_SKIP=locals $NR $W" "no-stack=NRUN_WATCH_SKIP=stack $NR $W" \
    "no-status=NRUN_WATCH_SKIP=status $NR $W" "no-fr=NRUN_WATCH_SKIP=fr $NR $W" \
    "no-ras=NRUN_WATCH_SKIP=ras $NR $W" "open-only=NRUN_WATCH_SKIP=stack,status,fr,ras,maps $NR $W" \
    2>/tmp/tail-runs
  cat /tmp/tail-runs
  for d in $(grep -o '/tmp/tail-[^)]*' /tmp/tail-runs); do
    [ -f "$d/trace" ] && { echo "== $d"; python3 scripts/bench/tail_cause.py "$d" "$d/trace"; }
  done
  ;;
dump)
  # A flight-recorder dump asked every FR_PERIOD s (no stall needed): what one dump costs the
  # workers, with nrun's settings (no stack traces in its dumps) and with torch's (traces).
  export NRUN_WATCH_FR_PERIOD=${FR_PERIOD:-3}
  D="NRUN_WATCH_TRACE=\$TAIL_DIR/trace $NR"
  python3 scripts/bench/step_tail.py "$ROUNDS" "watch-off=$NR --watch off $W" "dumps=$D $W" \
    "dumps-stack-traces=TORCH_INCLUDE_STACK_TRACE=1 $D $W" \
    2>/tmp/tail-runs
  cat /tmp/tail-runs
  for d in $(grep -o '/tmp/tail-[^)]*' /tmp/tail-runs); do
    [ -f "$d/trace" ] && { echo "== $(grep -F "$d" /tmp/tail-runs | cut -d: -f1)"; python3 scripts/bench/tail_cause.py "$d" "$d/trace" | grep -v '^ras\|^search\|^open\|^maps'; }
  done
  [ -n "${OUT:-}" ] && tar czf "$OUT/dump-runs.tgz" $(grep -o '/tmp/tail-[^)]*' /tmp/tail-runs) 2>/dev/null
  ;;
compare)
  runs=("watch-off=$NR --watch off $W" "watch-on=$NR $W" "torchrun=$TR")
  [ -n "${OLD:-}" ] && runs+=("old-watch-on=$OLD --nproc $NPROC --no-preflight $W")
  python3 scripts/bench/step_tail.py ${TAIL_JSON:+--json} "$ROUNDS" "${runs[@]}"
  ;;
esac

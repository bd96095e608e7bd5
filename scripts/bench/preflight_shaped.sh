#!/usr/bin/env bash
# The net preflight over a shaped link (issue 45): a 3-host namespace cluster
# (scripts/netns-cluster.sh), host 3's eth0 shaped to 20 Mbit/s (tc tbf; the veths say
# 10 Gb/s), `nrun --preflight-only --preflight net --nproc 1` RUNS times with each binary,
# alternating. Prints one line a run (binary, seconds, exit code, the first problem line), then
# each binary's count of exits.
#
#   scripts/bench/preflight_shaped.sh NEW_NRUN PREV_NRUN [RUNS]      (root: namespaces, tc)
#
# Env: RATE (20mbit), NAME (cluster, psh).
set -euo pipefail
new=$1 prev=$2 runs=${3:-10}
rate=${RATE:-20mbit} name=${NAME:-psh}
here=$(cd "$(dirname "$0")/../.." && pwd)
cfg=$(bash "$here/scripts/netns-cluster.sh" up 3 "$name" | tail -1)
trap 'bash "$here/scripts/netns-cluster.sh" down "$name" >/dev/null 2>&1' EXIT
ip netns exec "$name-h3" tc qdisc add dev eth0 root tbf rate "$rate" burst 64kbit latency 400ms
out=$(mktemp -d)
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $name-h3 at $rate"
declare -A codes
for r in $(seq 1 "$runs"); do
  for bin in new prev; do
    exe=$new
    [ "$bin" = prev ] && exe=$prev
    s=$(date +%s.%N)
    set +e
    timeout 600 "$exe" -H "$name-h1,$name-h2,$name-h3" --ssh-opts "-F $cfg" --no-python-probe \
      --preflight-only --preflight net --nproc 1 >"$out/out" 2>&1
    code=$?
    set -e
    took=$(echo "$(date +%s.%N) - $s" | bc)
    codes[$bin]+="$code "
    first=$(grep -m1 -E 'problem:|went silent' "$out/out" | sed 's/^ *//' || true)
    printf '%-4s %6.1f s  exit %-3s %s\n' "$bin" "$took" "$code" "${first:-"(no problem line)"}"
  done
done
for bin in new prev; do
  echo "$bin exits: $(echo "${codes[$bin]}" | tr ' ' '\n' | grep . | sort | uniq -c | awk '{printf "%s x %s, ", $1, $2}')"
done
rm -rf "$out"

#!/usr/bin/env bash
# bisect's time with one shaped node (issue 45): an 8-host namespace cluster
# (scripts/netns-cluster.sh), host 3's eth0 shaped to 20 Mbit/s (tc tbf; every veth says
# 10 Gb/s), `nrun bisect --probe net --nproc 1 --write-hostfile F` over the first 3, 4 and 8
# hosts, each binary in turn (new, then the previous one), RUNS times each. Prints one line a
# run: binary, nodes, seconds, exit code, the nodes not good (verdict), the hosts kept.
#
#   scripts/bench/bisect_shaped.sh NEW_NRUN PREV_NRUN [RUNS]      (root: namespaces, tc)
#
# PREV_NRUN `-`: the new binary alone (its spread over more runs, where the previous one takes
# minutes a run).
# Env: RATE (20mbit), PREV_TIMEOUT (600 s a run of the previous binary), NAME (cluster, bsh).
set -euo pipefail
new=$1 prev=$2 runs=${3:-1}
rate=${RATE:-20mbit} name=${NAME:-bsh}
here=$(cd "$(dirname "$0")/../.." && pwd)
cfg=$(bash "$here/scripts/netns-cluster.sh" up 8 "$name" | tail -1)
trap 'bash "$here/scripts/netns-cluster.sh" down "$name" >/dev/null 2>&1' EXIT
ip netns exec "$name-h3" tc qdisc add dev eth0 root tbf rate "$rate" burst 64kbit latency 400ms
out=$(mktemp -d)
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $name-h3 at $rate"
for k in 3 4 8; do
  hosts=$(seq -s, -f "$name-h%g" 1 "$k")
  for bin in new prev; do
    [ "$bin" = prev ] && [ "$prev" = - ] && continue
    exe=$new limit=600
    [ "$bin" = prev ] && exe=$prev limit=${PREV_TIMEOUT:-600}
    for r in $(seq 1 "$runs"); do
      rm -f "$out/good"
      s=$(date +%s.%N)
      set +e
      timeout "$limit" "$exe" bisect -H "$hosts" --ssh-opts "-F $cfg" --no-python-probe \
        --probe net --nproc 1 --write-hostfile "$out/good" >"$out/stdout" 2>"$out/stderr"
      code=$?
      set -e
      took=$(echo "$(date +%s.%N) - $s" | bc)
      named=$(awk '/^node /{t=1;next} / rounds \(/{t=0} t && $2!="good"{printf "%s %s; ", $1, $2}' "$out/stdout")
      rounds=$(grep -o '^[0-9]* rounds' "$out/stdout" || echo "? rounds")
      kept=$(paste -sd, "$out/good" 2>/dev/null || true)
      printf '%-4s %d nodes  %6.1f s  exit %-3s %-9s named: %s kept: %s\n' \
        "$bin" "$k" "$took" "$code" "$rounds" "${named:-none}" "${kept:--}"
    done
  done
done
rm -rf "$out"

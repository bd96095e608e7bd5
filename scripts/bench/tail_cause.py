#!/usr/bin/env python3
"""Lays the watch's looks (NRUN_WATCH_TRACE: `wall_s look rank us` per line) beside the workers'
steps (tail_worker.py's TAIL_DIR): for each kind of look, how many of the steps it fell in were
slow (over 1.5x the median), against the share of slow steps overall, and the median step it fell
in. A look that costs the workers shows as a much larger share.
    python3 tail_cause.py TAIL_DIR TRACE"""
import bisect, collections, os, statistics, sys

tail, trace = sys.argv[1], sys.argv[2]
steps = {}
for f in (x for x in os.listdir(tail) if x.startswith("rank")):
    rows = [tuple(map(float, l.split())) for l in open(os.path.join(tail, f))][20:]
    steps[int(f[4:])] = rows
alld = [d for r in steps.values() for _, d in r]
med = statistics.median(alld)
slow_share = sum(d > 1.5 * med for d in alld) / len(alld)
print(f"steps {len(alld)}, median {1e3 * med:.2f} ms, slow (>1.5x) {100 * slow_share:.1f}%")
starts = {r: [w for w, _ in rows] for r, rows in steps.items()}
hit = collections.defaultdict(list)
cost = collections.defaultdict(list)
for line in open(trace):
    t, look, rank, us = line.split()
    t, rank, us = float(t), int(rank), int(us)
    cost[look].append(us)
    # The step of every rank that was running when the look began (a look at one rank may
    # slow its peers through the collective).
    for r, rows in steps.items():
        i = bisect.bisect_right(starts[r], t) - 1
        if i >= 0 and t <= rows[i][0] + rows[i][1]:
            hit[look].append(rows[i][1])
for look in sorted(cost):
    h = hit[look]
    share = sum(d > 1.5 * med for d in h) / len(h) if h else 0
    print(f"{look:8} {len(cost[look]):5} looks, mean {statistics.fmean(cost[look]):8.0f} us, "
          f"max {max(cost[look]):8d} us; steps hit {len(h):5}, slow {100 * share:5.1f}%, "
          f"median of those {1e3 * statistics.median(h) if h else 0:.2f} ms")

# Steps in the seconds after a flight-recorder dump was asked (torch writes it a few seconds
# later), against the others.
W = float(os.environ.get("DUMP_WINDOW", "8"))
asks = sorted(float(l.split()[0]) for l in open(trace) if l.split()[1] == "fr")
inside, outside = [], []
for rows in steps.values():
    for w, d in rows:
        j = bisect.bisect_right(asks, w) - 1
        (inside if j >= 0 and w - asks[j] <= W else outside).append(d)
for name, v in (("after a dump asked", inside), ("other steps", outside)):
    if v:
        print(f"{name:20} {len(v):5} steps, mean {1e3 * statistics.fmean(v):.2f} ms, "
              f"slow {100 * sum(d > 1.5 * med for d in v) / len(v):.1f}%")

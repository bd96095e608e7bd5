#!/usr/bin/env python3
"""Step-time distributions under launchers, alternating their order every round:
`python3 step_tail.py ROUNDS NAME=CMD...`, each CMD a shell line that runs tail_worker.py with
TAIL_DIR (set here, fresh per run) in its environment. Steps 0..SKIP (default 20) are warm-up and
left out. For each launcher: mean, median, p90, p99 and max of every rank's steps, and the steps
over 2x the FIRST launcher's median (the baseline's), per round (min-max over rounds) and pooled;
then each launcher's mean and p99 over the first's, per round. JSON lines with --json."""
import json, os, statistics, subprocess, sys, tempfile

args = [a for a in sys.argv[1:] if a != "--json"]
as_json = "--json" in sys.argv
rounds = int(args[0])
runs = [a.split("=", 1) for a in args[1:]]
skip = int(os.environ.get("SKIP", "20"))


def pct(s, q):
    return s[min(len(s) - 1, int(q * len(s)))]


def stats(steps, base_median):
    s = sorted(steps)
    return {
        "steps": len(s), "mean_ms": 1e3 * statistics.fmean(s), "median_ms": 1e3 * pct(s, 0.5),
        "p90_ms": 1e3 * pct(s, 0.9), "p99_ms": 1e3 * pct(s, 0.99), "max_ms": 1e3 * s[-1],
        "over_2x": sum(1 for x in s if base_median and x > 2 * base_median),
    }


got = {name: [] for name, _ in runs}
for r in range(rounds):
    order = runs if r % 2 == 0 else runs[::-1]
    for name, cmd in order:
        d = tempfile.mkdtemp(prefix="tail-")
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True,
                             env=dict(os.environ, TAIL_DIR=d))
        steps = []
        for f in sorted(x for x in os.listdir(d) if x.startswith("rank")):
            with open(os.path.join(d, f)) as fh:
                steps += [float(l.split()[1]) for l in fh.readlines()[skip:]]
        if out.returncode != 0 or not steps:
            print(f"{name}: rc={out.returncode}\n{out.stderr[-3000:]}", flush=True)
            continue
        got[name].append((r, steps, d))
        print(f"round {r} {name}: mean {1e3 * statistics.fmean(steps):.2f} ms, "
              f"max {1e3 * max(steps):.1f} ms ({d})", file=sys.stderr, flush=True)

first = runs[0][0]
base = {r: statistics.median(s) for r, s, _ in got[first]}
base_all = statistics.median([x for _, s, _ in got[first] for x in s]) if got[first] else None
for name, _ in runs:
    per = [stats(s, base.get(r, base_all)) for r, s, _ in got[name]]
    pooled = stats([x for _, s, _ in got[name] for x in s], base_all) if per else {}
    mean_ratio = [statistics.fmean(s) / statistics.fmean(b) for r, s, _ in got[name]
                  for rb, b, _ in got[first] if rb == r]
    p99_ratio = [pct(sorted(s), 0.99) / pct(sorted(b), 0.99) for r, s, _ in got[name]
                 for rb, b, _ in got[first] if rb == r]
    row = {"label": name, "rounds": len(per), "pooled": pooled,
           "per_round": {k: [min(p[k] for p in per), max(p[k] for p in per)] for k in pooled},
           "mean_over_first": mean_ratio, "p99_over_first": p99_ratio}
    if as_json:
        print(json.dumps(row), flush=True)
    else:
        rng = row["per_round"]
        f = lambda k: f"{rng[k][0]:.2f}-{rng[k][1]:.2f}" if k in rng else "?"
        print(f"{name:28} mean {f('mean_ms')}  median {f('median_ms')}  p90 {f('p90_ms')}  "
              f"p99 {f('p99_ms')}  max {f('max_ms')} ms  over 2x {f('over_2x')}  "
              f"mean/first {['%.3f' % x for x in mean_ratio]}  "
              f"p99/first {['%.3f' % x for x in p99_ratio]}  pooled mean "
              f"{pooled.get('mean_ms', 0):.2f} p99 {pooled.get('p99_ms', 0):.2f} ms", flush=True)

"""Launch at scale on loopback hosts (issue 21): N nodes `-H 127.1.x.y,...` (each treated as
this machine: a local agent, no ssh), `--nproc 1 --no-python true`, for each binary given,
alternating binaries within each round so that a shared machine's noise falls on all alike.

Per run: wall (start to exit), nrun's own CPU (its `NRUN_LOG=debug` line: the coordinator
alone, not its agents), peak RSS (GNU time's %M: the largest process of the tree, the
coordinator), the coordinator's most open descriptors (sampled every 20 ms from /proc), and
the exit code. Medians per size and binary are printed as a markdown table; raw runs as JSON
lines to stderr.

Usage: scale.py RUNS SIZES NAME=BINARY [NAME=BINARY ...]
  e.g. scale.py 3 64,256,1024,2048 before=/tmp/nrun-before after=target/release/nrun
Environment: SCALE_NOFILE=1024 runs under that hard and soft open-file limit (prlimit).
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nrun_stats import cpu_and_rss, run  # noqa: E402


def hosts(n):
    return ",".join(f"127.1.{i // 250}.{i % 250 + 1}" for i in range(n))


def coordinator(keeper):
    """The real nrun under the keeper: its child that is not the watch."""
    try:
        kids = open(f"/proc/{keeper}/task/{keeper}/children").read().split()
    except OSError:
        return None
    for k in kids:
        try:
            if open(f"/proc/{k}/comm").read().strip() != "nr-watch":
                return int(k)
        except OSError:
            pass
    return None


def one(binary, n):
    cmd = ["/usr/bin/time", "-f", "%e %M", binary, "-H", hosts(n), "--nproc", "1",
           "--no-python", "true"]
    nofile = os.environ.get("SCALE_NOFILE")
    if nofile:
        cmd = ["prlimit", f"--nofile={nofile}:{nofile}", "--"] + cmd
    env = dict(os.environ, NRUN_LOG="debug")
    most = [0]
    found = [None]

    def look(timepid):
        # GNU time's child is the keeper; the coordinator is the keeper's child.
        if found[0] is None:
            kids = open(f"/proc/{timepid}/task/{timepid}/children").read().split()
            keeper = [k for k in kids if k]
            if keeper and os.path.exists(f"/proc/{keeper[0]}"):
                # prlimit execs: its pid is GNU time's.
                found[0] = coordinator(int(keeper[0]))
        if found[0] is not None:
            most[0] = max(most[0], len(os.listdir(f"/proc/{found[0]}/fd")))

    rc, err, wall = run(cmd, env, look)
    cpu, rss_kb = cpu_and_rss(err)
    x = {"n": n, "wall_s": wall, "cpu_s": cpu, "rss_mib": rss_kb and rss_kb / 1024,
         "fds": most[0], "rc": rc}
    if rc != 0:
        # What nrun said of a failed run (its last lines), to find out why.
        x["stderr_tail"] = err[-4000:]
    return x


def main():
    runs = int(sys.argv[1])
    sizes = [int(s) for s in sys.argv[2].split(",")]
    bins = [a.split("=", 1) for a in sys.argv[3:]]
    res = {}
    for n in sizes:
        for r in range(runs):
            # Alternate the order too, so neither binary always runs first.
            order = bins if r % 2 == 0 else bins[::-1]
            for name, b in order:
                x = one(b, n)
                x["bin"] = name
                print(json.dumps(x), file=sys.stderr, flush=True)
                res.setdefault((n, name), []).append(x)
    load = open("/proc/loadavg").read().split()[0]
    print(f"| nodes | binary | runs | ok | median wall | median nrun CPU | median peak RSS "
          f"| median most fds | (load {load}) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (n, name), xs in res.items():
        ok = [x for x in xs if x["rc"] == 0]
        med = lambda k: statistics.median([x[k] for x in ok if x[k] is not None]) if ok else float("nan")
        print(f"| {n} | {name} | {len(xs)} | {len(ok)} | {med('wall_s'):.2f} s | {med('cpu_s'):.2f} s "
              f"| {med('rss_mib'):.0f} MiB | {med('fds'):.0f} | |")


if __name__ == "__main__":
    main()

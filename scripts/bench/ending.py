"""Thousands of local workers ending (issue 35, item 2): `nrun --nproc N --no-python`, each
worker `sh -c 'touch DIR/$RANK; exec sleep S'`, for each binary given, alternating binaries
within each round so that a shared machine's noise falls on all alike.

Two ways to end:
- end: the workers sleep 3 s and exit 0. `end` is nrun's exit minus the last worker's end
  (the newest marker file's time plus 3 s).
- term: the workers sleep 600 s; once every marker is there, SIGTERM to nrun (its keeper, the
  pid a user sees). `end` is nrun's exit minus the signal.

Per run: wall (start to exit), end (above), nrun's peak RSS (wait4's ru_maxrss: the largest
process of nrun's tree, nrun itself, the workers being sleep), the exit code. A run is capped
at 4 GiB of address space a process (RLIMIT_AS) and 90 s, so a runaway fails the run, not the
machine (run it inside a memory cgroup too: a runaway's workers may outlive it). A run killed
by the cap reports only its keeper's RSS. Medians per size, mode and binary are printed as a markdown table; raw runs as JSON
lines to stderr.

Usage: ending.py RUNS SIZES NAME=BINARY [NAME=BINARY ...]
  e.g. ending.py 3 1024,2048,4096 before=/work/main/target/release/nrun after=target/release/nrun
"""
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CAP_AS = 4 << 30
CAP_S = 90
SLEEP = 3


def limits():
    resource.setrlimit(resource.RLIMIT_AS, (CAP_AS, CAP_AS))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 65536), hard), hard))


def markers(d):
    return [os.path.join(d, f) for f in os.listdir(d)]


def one(binary, n, mode):
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as d:
        sleep = SLEEP if mode == "end" else 600
        cmd = [binary, "--nproc", str(n), "--no-python", "sh", "-c",
               f"touch {d}/$RANK; exec sleep {sleep}"]
        began = time.monotonic()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, preexec_fn=limits)
        sent = None
        status, ru = None, None
        while status is None:
            pid, st, r = os.wait4(p.pid, os.WNOHANG)
            if pid:
                status, ru = st, r
                break
            now = time.monotonic()
            if mode == "term" and sent is None and len(os.listdir(d)) >= n:
                os.kill(p.pid, signal.SIGTERM)
                sent = now
            if now - began > CAP_S:
                os.kill(p.pid, signal.SIGKILL)
            time.sleep(0.01)
        ended, ended_wall = time.monotonic(), time.time()
        if mode == "end":
            # Marker times are wall-clock: compared with the wall clock at nrun's exit.
            newest = max((os.stat(f).st_mtime for f in markers(d)), default=None)
            end = ended_wall - (newest + SLEEP) if newest else None
        else:
            end = ended - sent if sent else None
        code = os.waitstatus_to_exitcode(status)
        return {"wall": ended - began, "end": end, "rss_mib": ru.ru_maxrss / 1024,
                "code": code, "started": len(os.listdir(d))}


def main():
    runs, sizes = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
    bins = [a.split("=", 1) for a in sys.argv[3:]]
    rows = {}
    for _ in range(runs):
        for n in sizes:
            for mode in ("end", "term"):
                for name, b in bins:
                    r = one(b, n, mode)
                    r.update(name=name, n=n, mode=mode)
                    print(json.dumps(r), file=sys.stderr, flush=True)
                    rows.setdefault((n, mode, name), []).append(r)

    def med(rs, k):
        v = [r[k] for r in rs if r[k] is not None]
        return statistics.median(v) if v else float("nan")

    print("| workers | ending | binary | wall s | end s | nrun peak RSS MiB | exit codes |")
    print("|---:|---|---|---:|---:|---:|---|")
    for (n, mode, name), rs in rows.items():
        codes = ",".join(str(r["code"]) for r in rs)
        print(f"| {n} | {mode} | {name} | {med(rs, 'wall'):.2f} | {med(rs, 'end'):.2f} | "
              f"{med(rs, 'rss_mib'):.0f} | {codes} |")


if __name__ == "__main__":
    main()

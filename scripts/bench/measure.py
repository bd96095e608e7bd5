"""Runs a command repeatedly and reports wall time and peak memory, as one JSON line.

Peak memory is the largest RSS of any process in the command's tree, as GNU time reports it
(ru_maxrss). The command runs under /usr/bin/time rather than straight from this script: a
process spawned from Python would inherit the Python process's RSS high-water mark through
vfork and report ~14 MiB for `true`. The wall time therefore includes GNU time's own fork and
exec (well under a millisecond), the same for every command measured.

    measure.py LABEL RUNS [--timeout S] -- CMD ARGS...
"""
import json
import os
import signal
import statistics
import sys
import time


def main():
    label, runs = sys.argv[1], int(sys.argv[2])
    rest = sys.argv[3:]
    timeout = None
    if rest and rest[0] == "--timeout":
        timeout = float(rest[1])
        rest = rest[2:]
    assert rest[0] == "--"
    cmd = rest[1:]
    walls, rss, codes = [], [], []
    devnull = os.open(os.devnull, os.O_WRONLY)
    rss_file = f"/tmp/measure-{os.getpid()}.rss"
    cmd = ["/usr/bin/time", "-f", "%M", "-o", rss_file] + cmd
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        pid = os.posix_spawnp(cmd[0], cmd, os.environ,
                              file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 1),
                                            (os.POSIX_SPAWN_DUP2, devnull, 2)],
                              setpgroup=0)
        timed_out = False
        while True:
            wpid, status, ru = os.wait4(pid, os.WNOHANG)
            if wpid == pid:
                break
            if timeout is not None and (time.perf_counter_ns() - t0) / 1e9 > timeout:
                os.killpg(pid, signal.SIGKILL)
                timed_out = True
            time.sleep(0.0002)
        wall = (time.perf_counter_ns() - t0) / 1e6
        if timed_out:
            codes.append("timeout")
            break
        walls.append(wall)
        with open(rss_file) as f:
            rss.append(int(f.read().split()[-1]) / 1024)
        codes.append(os.waitstatus_to_exitcode(status))
    out = {"label": label, "runs": len(walls), "exit_codes": sorted(set(map(str, codes))),
           "wall_ms": [round(w, 2) for w in walls]}
    if walls:
        out["median_wall_ms"] = round(statistics.median(walls), 2)
        out["min_wall_ms"] = round(min(walls), 2)
        out["median_peak_mib"] = round(statistics.median(rss), 1)
    if "timeout" in codes:
        out["timed_out_after_s"] = timeout
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

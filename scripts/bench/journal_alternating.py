"""The journal's cost on a launch: 8 copies of `true` through nrun without and with --events
and --metrics-file (and --metrics-port), alternating, the order reversed every round (as
launch_alternating.py), so a shared machine's noise falls on all alike.
Usage: journal_alternating.py RUNS [NRUN]"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

nrun = sys.argv[2] if len(sys.argv) > 2 else "target/release/nrun"
d = tempfile.mkdtemp()
plain = [nrun, "--nproc", "8", "--no-python", "true"]
cmds = {"plain": plain,
        "events+file": plain[:1] + ["--events", f"{d}/e.jsonl", "--metrics-file", f"{d}/m.prom"] + plain[1:],
        "events+file+port": plain[:1] + ["--events", f"{d}/e2.jsonl", "--metrics-file", f"{d}/m2.prom",
                                         "--metrics-port", "19464"] + plain[1:]}
t = {k: [] for k in cmds}
for i in range(int(sys.argv[1])):
    for k, c in (list(cmds.items()) if i % 2 == 0 else list(cmds.items())[::-1]):
        s = time.perf_counter(); r = subprocess.run(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); e = time.perf_counter() - s
        if r.returncode == 0: t[k].append(e * 1000)
base = statistics.median(t["plain"])
for k, v in t.items():
    m = statistics.median(v)
    print(f"{k}: n={len(v)} median={m:.2f} ms min={min(v):.2f} ms ({100 * (m / base - 1):+.2f}% vs plain)")

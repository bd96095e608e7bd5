"""8 copies of `true` through nrun, an earlier nrun (NRUN_BASE) and mpirun, alternating, so
that a shared machine's noise falls on all three alike; the order is reversed every round (the
first of a round ran slower by ~0.5 ms, which a fixed order charged to nrun alone).
Usage: launch_alternating.py RUNS"""
import os
import statistics
import subprocess
import sys
import time

base = os.environ.get("NRUN_BASE", "./nrun-base")
cmds = {"nrun": ["target/release/nrun", "--nproc", "8", "--no-python", "true"],
        "nrun-base": [base, "--nproc", "8", "--no-python", "true"],
        "mpirun": ["mpirun","--allow-run-as-root","--oversubscribe","-np","8","true"]}
t = {k: [] for k in cmds}
for i in range(int(sys.argv[1])):
    for k, c in (list(cmds.items()) if i % 2 == 0 else list(cmds.items())[::-1]):
        s = time.perf_counter(); r = subprocess.run(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); e = time.perf_counter() - s
        if r.returncode == 0: t[k].append(e * 1000)
for k, v in t.items():
    print(f"{k}: n={len(v)} median={statistics.median(v):.2f} ms min={min(v):.2f} ms" if v else f"{k}: failed")
print(f"ratio nrun/mpirun = {statistics.median(t['nrun'])/statistics.median(t['mpirun']):.3f}")

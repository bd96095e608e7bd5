"""The watch's benchmarks, each against the same run without it or against its target:

1. overhead: scripts/bench/watch_loop.py on 8 ranks with --watch on and off, alternating;
   the median step time of each, and nrun's own CPU (NRUN_LOG=debug prints it) per second.
2. time to diagnosis: tests/python/hang.py's `sleep` case (rank 1 stops before a collective and
   prints when); the time from that moment to nrun's `hang:` line, against --hang-timeout.

    python3 scripts/bench/watch_bench.py NRUN PYTHON RUNS   (prints JSON lines)
"""

import json
import re
import statistics
import subprocess
import sys
import time

nrun, py, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
env_common = {"NCCL_NVLS_ENABLE": "0"}


def run_loop(watch):
    import os
    # Long enough that nrun's start-up (opening each worker once) does not dominate its CPU.
    env = dict(os.environ, NRUN_LOG="debug", STEPS=os.environ.get("STEPS", "1500"), **env_common)
    out = subprocess.run([nrun, "--nproc", "8", "--python", py, "--watch", watch,
                          "scripts/bench/watch_loop.py"], capture_output=True, text=True, env=env)
    step = float(re.search(r"step_ms ([0-9.]+)", out.stdout).group(1))
    m = re.search(r"own CPU: ([0-9.]+) s user \+ ([0-9.]+) s system in ([0-9.]+) s", out.stderr)
    cpu, wall = float(m.group(1)) + float(m.group(2)), float(m.group(3))
    return step, cpu, wall


res = {"on": [], "off": []}
for _ in range(runs):
    for w in ("on", "off"):
        res[w].append(run_loop(w))
for w, v in res.items():
    print(json.dumps({"label": f"watch-overhead/{w}", "runs": len(v),
                      "median_step_ms": statistics.median(x[0] for x in v),
                      "median_cpu_pct_of_core": statistics.median(100 * x[1] / x[2] for x in v)}))
on = statistics.median(x[0] for x in res["on"])
off = statistics.median(x[0] for x in res["off"])
print(json.dumps({"label": "watch-overhead/ratio", "step_time_on_over_off": on / off}))


def diagnosis(timeout, nproc):
    import os
    env = dict(os.environ, NRUN_HANG_CASE="sleep", **env_common)
    p = subprocess.Popen([nrun, "--nproc", str(nproc), "--python", py, "--hang-timeout", str(timeout),
                          "--on-hang", "stop", "tests/python/hang.py"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stalled = None
    for line in p.stdout:
        m = re.search(r"stalled at ([0-9.]+)", line)
        if m:
            stalled = float(m.group(1))
            break
    said = None
    for line in p.stderr:
        if line.startswith("nrun: hang:") and said is None:
            said = time.time()
    p.wait()
    return said - stalled if (said and stalled) else None


for timeout, nproc in ((10, 4), (60, 4)):
    d = [diagnosis(timeout, nproc) for _ in range(max(1, runs // 3))]
    d = [x for x in d if x is not None]
    print(json.dumps({"label": f"watch-diagnosis/timeout{timeout}", "runs": len(d),
                      "median_s": statistics.median(d) if d else None, "max_s": max(d) if d else None,
                      "target_s": timeout + 10}))

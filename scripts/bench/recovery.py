"""Recovery from a lost node, nrun beside torchrun, on namespace hosts (scripts/netns-cluster.sh;
needs root). A gloo DDP loop (recovery_train.py, ~10 steps/s) runs; one node "dies" (every
process of the job in its namespace killed with SIGKILL) or is cut off (iptables drops all its
packets). Measured from that moment, per trial:
  named   nrun's line naming the node lost (nrun only)
  start   rank 0 of the new worker group starts (nrun's own part: detection, stop, restart)
  step    the first training step of the new group (adds torch's import and DDP set-up)
  world   the new group's world size (nrun with a spare: back to full size)
Usage: recovery.py NRUN PYTHON [TRIALS] ; prints JSON lines, then a markdown table."""

import json
import os
import sys
import time

from nshosts import HERE, Hosts, Watch, fmt, med, popen, stop

NRUN, PY = sys.argv[1], sys.argv[2]
TRIALS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
TRAIN = os.path.join(HERE, "recovery_train.py")
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
ENV = {"SECONDS_TO_RUN": "20"}


def measure(procs, watch, how, victim, new_world):
    """Waits for steady training, takes the victim node out, measures the recovery."""
    if not watch.wait(r"step 20 world", 90):
        return {"error": "never trained", "tail": watch.tail()}
    t0 = time.time()
    if how == "kill":
        H.kill(victim)
    else:
        H.cut(victim)
    r = {}
    named = watch.wait(r"leaving out|lost", 90, t0)
    r["named"] = round(named[0] - t0, 3) if named else None
    start = watch.wait(r"start restart [1-9]\d* t=([\d.]+)", 150, t0)
    r["start"] = round(float(start[1].group(1)) - t0, 3) if start else None
    step = watch.wait(r"step \d+ world (\d+) restart [1-9]\d* t=([\d.]+)", 150, t0)
    if step:
        r["step"] = round(float(step[1].group(2)) - t0, 3)
        r["world"] = int(step[1].group(1))
    else:
        r["step"], r["world"] = None, None
    r["full_size"] = r["world"] == new_world
    return r


def nrun_ssh(how):
    hosts = ",".join(H.host(i) for i in range(1, 6))
    p = popen([NRUN, "-H", hosts, "--ssh-opts", f"-F {H.config}", "--nnodes", "4",
               "--max-restarts", "3", "--nproc", "1", "--no-python-probe",
               "--python", PY, TRAIN], ENV)
    w = Watch()
    w.add(p)
    r = measure([p], w, how, 3, 4)
    stop([p])
    return r


def nrun_c10d(how):
    ep = f"{H.addr(1)}:29411"
    procs = []
    for i in range(1, 5):
        procs.append(popen(["ip", "netns", "exec", H.host(i), NRUN, "--nnodes", "3", "--spares", "1",
                            "--rdzv-backend", "c10d", "--rdzv-endpoint", ep, "--rdzv-id", "rcv",
                            "--max-restarts", "3", "--nproc", "1", "--no-python-probe",
                            "--python", PY, TRAIN], ENV))
        time.sleep(0.3)
    w = Watch()
    for p in procs:
        w.add(p)
    r = measure(procs, w, how, 3, 3)
    stop(procs)
    return r


def torchrun_c10d(how):
    ep = f"{H.addr(1)}:29412"
    procs = []
    for i in range(1, 4):
        # Namespace hosts share a host name: torchrun is told which one hosts its store.
        procs.append(popen(["ip", "netns", "exec", H.host(i), TORCHRUN, "--nnodes", "2:3",
                            "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", ep, "--rdzv-id", "rcv", "--max-restarts", "3",
                            "--rdzv-conf", f"is_host={'true' if i == 1 else 'false'}",
                            TRAIN], ENV))
    w = Watch()
    for p in procs:
        w.add(p)
    r = measure(procs, w, how, 3, 2)
    stop(procs)
    return r


CASES = [
    ("nrun ssh, 5 hosts --nnodes 4 (a spare)", nrun_ssh),
    ("nrun c10d, --nnodes 3 --spares 1", nrun_c10d),
    ("torchrun c10d, --nnodes 2:3", torchrun_c10d),
]

results = []
H = Hosts("rcv", 5)
try:
    for label, fn in CASES:
        for how in ("kill", "cut"):
            for trial in range(TRIALS):
                r = fn(how)
                H.uncut(3)
                r.update({"case": label, "how": how, "trial": trial})
                print(json.dumps(r), flush=True)
                results.append(r)
                # Leftovers of a torchrun that does not clean up end with the namespace.
                for i in range(1, 6):
                    H.kill(i)
                time.sleep(1)
finally:
    H.down()


print("\n| case | node | named (s) | nrun's part: new group starts (s) | first step (s) | world after | trials |")
print("|---|---|---|---|---|---|---|")
for label, _ in CASES:
    for how in ("kill", "cut"):
        rs = [r for r in results if r["case"] == label and r["how"] == how]
        steps = [r.get("step") for r in rs]
        print(f"| {label} | {'kill -9' if how == 'kill' else 'packets dropped'} | "
              f"{fmt(med([r.get('named') for r in rs]))} | {fmt(med([r.get('start') for r in rs]))} | "
              f"{fmt(med(steps))} ({' / '.join(fmt(s) for s in steps)}) | "
              f"{', '.join(str(r.get('world')) for r in rs)} | {len(rs)} |")

"""The rendezvous host lost, nrun beside torchrun, on namespace hosts (scripts/netns-cluster.sh;
needs root). Three nodes run the same c10d command (`--nnodes 1:3`, gloo DDP loop of
recovery_train.py at ~10 steps/s); then, per case:
  host    node 1, which hosts the rendezvous, dies (every process of its namespace: SIGKILL);
          later its launcher is started again with the same command
  other   node 3 dies the same way; later started again
  cut     node 3 is cut off (iptables drops all its packets); later let through again
Measured from the fault, per trial:
  start   the first worker of a new group starts (the launcher's own part: detection,
          succession, re-forming, starting workers)
  step    that group's first training step (adds torch's import and set-up), and its world size
  back    from the node's return (restart or let through) to a step at world 3 (None: not
          within 90 s)
  worlds  most distinct stores (MASTER_ADDR) whose worlds printed steps within the same second
          after the fault (1: one world trains at a time)
Usage: succession.py NRUN PYTHON [TRIALS] [CASES] ; CASES a comma list of host,other,cut;
prints JSON lines, then a markdown table."""

import json
import re
import os
import sys
import time

from nshosts import HERE, Hosts, Watch, fmt, med, popen, stop

NRUN, PY = sys.argv[1], sys.argv[2]
TRIALS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
WHICH = (sys.argv[4] if len(sys.argv) > 4 else "host,other,cut").split(",")
TRAIN = os.path.join(HERE, "recovery_train.py")
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
ENV = {"SECONDS_TO_RUN": "150", "NRUN_RDZV_SECRET": "bench-secret"}
STEP = r"step \d+ world (\d+) restart \d+ t=([\d.]+) master=(\S+)"


def nrun_cmd(i, port):
    return ["ip", "netns", "exec", H.host(i), NRUN, "--nnodes", "1:3", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{H.addr(1)}:{port}", "--rdzv-id", "scc", "--max-restarts", "5",
            "--nproc", "1", "--no-python-probe", "--python", PY, TRAIN]


def torchrun_cmd(i, port):
    # Namespace hosts share a host name: torchrun is told which one hosts its store, and each
    # node's own address (else it advertises the shared name as MASTER_ADDR).
    return ["ip", "netns", "exec", H.host(i), TORCHRUN, "--nnodes", "1:3", "--nproc-per-node", "1",
            "--local-addr", H.addr(i),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{H.addr(1)}:{port}", "--rdzv-id",
            "scc", "--max-restarts", "5", "--rdzv-conf",
            f"is_host={'true' if i == 1 else 'false'}", TRAIN]


def worlds_at_once(w, t0):
    """The most distinct stores whose worlds printed a step within one second after t0."""
    seen = {}
    with w.lock:
        for t, _, line in w.lines:
            if t < t0:
                continue
            m = re.search(STEP, line)
            if m:
                seen.setdefault(int(float(m.group(2))), set()).add(m.group(3))
    return max((len(v) for v in seen.values()), default=0)


def trial(cmd, port, case):
    w = Watch()
    procs = []
    for i in (1, 2, 3):
        procs.append(w.add(popen(cmd(i, port), ENV), f"h{i}"))
        time.sleep(0.5)
    r = {}
    try:
        if not w.wait(r"step 20 world 3", 120):
            return {"error": "never trained at world 3", "tail": w.tail()}
        victim = 1 if case == "host" else 3
        t0 = time.time()
        if case == "cut":
            H.cut(victim)
        else:
            H.kill(victim)
        start = w.wait(r"start restart \d+ t=([\d.]+)", 120, t0)
        r["start"] = round(float(start[1].group(1)) - t0, 3) if start else None
        step = w.wait(STEP, 120, start[0] if start else t0) if start else None
        if step:
            r["step"] = round(float(step[1].group(2)) - t0, 3)
            r["world"] = int(step[1].group(1))
        else:
            r["step"], r["world"] = None, None
            r["tail"] = w.tail()
        # The node returns: started again with the same command, or let through.
        t1 = time.time()
        if case == "cut":
            H.uncut(victim)
        else:
            procs.append(w.add(popen(cmd(victim, port), ENV), f"h{victim}'"))
        back = w.wait(r"step \d+ world 3 restart \d+ t=([\d.]+)", 90, t1)
        r["back"] = round(back[0] - t1, 3) if back else None
        r["worlds"] = worlds_at_once(w, t0)
        return r
    finally:
        stop(procs)
        for i in (1, 2, 3):
            H.kill(i)
            H.uncut(i)


LAUNCHERS = [("nrun", nrun_cmd, 29421), ("torchrun", torchrun_cmd, 29422)]
CASE_WORDS = {"host": "the host node killed", "other": "another node killed",
              "cut": "a node cut off and back"}

H = Hosts("scc", 3, names_file=True)
results = []
try:
    for case in WHICH:
        for n in range(TRIALS):
            # The launchers alternate within each round.
            for name, cmd, port in LAUNCHERS:
                r = trial(cmd, port, case)
                r.update({"launcher": name, "case": case, "trial": n})
                print(json.dumps(r), flush=True)
                results.append(r)
                time.sleep(1)
finally:
    H.down()

print("\n| case | launcher | new group starts (s) | first step (s) | world then | back to 3 (s) | "
      "worlds at once | trials |")
print("|---|---|---|---|---|---|---|---|")
for case in WHICH:
    for name, _, _ in LAUNCHERS:
        rs = [r for r in results if r["case"] == case and r["launcher"] == name]
        col = lambda k: [r.get(k) for r in rs]  # noqa: E731
        print(f"| {CASE_WORDS[case]} | {name} | {fmt(med(col('start')))} "
              f"({' / '.join(fmt(x) for x in col('start'))}) | {fmt(med(col('step')))} | "
              f"{', '.join(str(x) for x in col('world'))} | "
              f"{' / '.join(fmt(x) for x in col('back'))} | "
              f"{max((x or 0) for x in col('worlds')) if rs else '-'} | {len(rs)} |")

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
import re
import subprocess
import sys
import threading
import time

NRUN, PY = sys.argv[1], sys.argv[2]
TRIALS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRAIN = os.path.join(HERE, "recovery_train.py")
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
NAME = "rcv"


def sh(cmd, check=True):
    return subprocess.run(cmd, shell=True, check=check, capture_output=True, text=True)


def cluster_up(k):
    out = sh(f"bash {ROOT}/scripts/netns-cluster.sh up {k} {NAME}").stdout.strip().splitlines()
    return out[-1]


def cluster_down():
    sh(f"bash {ROOT}/scripts/netns-cluster.sh down {NAME}", check=False)


def host(i):
    return f"{NAME}-h{i}"


def addr(i):
    env = open(os.path.join(os.path.dirname(CONFIG), "cluster.env")).read()
    net = re.search(r"NRUN_CLUSTER_NET=(\d+)", env).group(1)
    return f"10.213.{net}.{10 + i}"


def job_pids(i, needle=None):
    """Processes of the job in host i's namespace (not its sshd)."""
    pids = sh(f"ip netns pids {host(i)}", check=False).stdout.split()
    out = []
    for p in pids:
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "sshd" in cmd or not cmd:
            continue
        if needle is None or needle in cmd:
            out.append(p)
    return out


def kill_node(i):
    pids = job_pids(i)
    if pids:
        sh("kill -9 " + " ".join(pids), check=False)


def cut_node(i):
    sh(f"ip netns exec {host(i)} sh -c 'iptables -A INPUT -j DROP; iptables -A OUTPUT -j DROP'")


def uncut_node(i):
    sh(f"ip netns exec {host(i)} sh -c 'iptables -F INPUT; iptables -F OUTPUT'", check=False)


class Watch:
    """Reads a process's stdout and stderr lines, each stamped with its arrival time."""

    def __init__(self, procs):
        self.lines = []
        self.lock = threading.Lock()
        for p in procs:
            for stream in (p.stdout, p.stderr):
                threading.Thread(target=self.read, args=(stream,), daemon=True).start()

    def read(self, stream):
        for line in stream:
            with self.lock:
                self.lines.append((time.time(), line.rstrip("\n")))

    def find(self, pattern, after=0.0):
        with self.lock:
            for t, line in self.lines:
                m = re.search(pattern, line)
                if m and t >= after:
                    return t, m, line
        return None

    def wait(self, pattern, timeout, after=0.0):
        end = time.time() + timeout
        while time.time() < end:
            got = self.find(pattern, after)
            if got:
                return got
            time.sleep(0.05)
        return None


def measure(procs, watch, how, victim, new_world):
    """Waits for steady training, takes the victim node out, measures the recovery."""
    if not watch.wait(r"step 20 world", 90):
        return {"error": "never trained", "tail": [l for _, l in watch.lines[-15:]]}
    t0 = time.time()
    if how == "kill":
        kill_node(victim)
    else:
        cut_node(victim)
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


def stop(procs):
    for p in procs:
        try:
            p.terminate()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def popen(cmd, env=None):
    e = dict(os.environ, NCCL_NVLS_ENABLE="0", SECONDS_TO_RUN="20", **(env or {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)


def nrun_ssh(how):
    hosts = ",".join(host(i) for i in range(1, 6))
    p = popen([NRUN, "-H", hosts, "--ssh-opts", f"-F {CONFIG}", "--nnodes", "4",
               "--max-restarts", "3", "--nproc", "1", "--no-python-probe",
               "--python", PY, TRAIN])
    w = Watch([p])
    r = measure([p], w, how, 3, 4)
    stop([p])
    return r


def nrun_c10d(how):
    ep = f"{addr(1)}:29411"
    procs = []
    for i in range(1, 5):
        procs.append(popen(["ip", "netns", "exec", host(i), NRUN, "--nnodes", "3", "--spares", "1",
                            "--rdzv-backend", "c10d", "--rdzv-endpoint", ep, "--rdzv-id", "rcv",
                            "--max-restarts", "3", "--nproc", "1", "--no-python-probe",
                            "--python", PY, TRAIN]))
        time.sleep(0.3)
    w = Watch(procs)
    r = measure(procs, w, how, 3, 3)
    stop(procs)
    return r


def torchrun_c10d(how):
    ep = f"{addr(1)}:29412"
    procs = []
    for i in range(1, 4):
        # Namespace hosts share a host name: torchrun is told which one hosts its store.
        procs.append(popen(["ip", "netns", "exec", host(i), TORCHRUN, "--nnodes", "2:3",
                            "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", ep, "--rdzv-id", "rcv", "--max-restarts", "3",
                            "--rdzv-conf", f"is_host={'true' if i == 1 else 'false'}",
                            TRAIN]))
    w = Watch(procs)
    r = measure(procs, w, how, 3, 2)
    stop(procs)
    return r


CASES = [
    ("nrun ssh, 5 hosts --nnodes 4 (a spare)", nrun_ssh),
    ("nrun c10d, --nnodes 3 --spares 1", nrun_c10d),
    ("torchrun c10d, --nnodes 2:3", torchrun_c10d),
]

results = []
try:
    cluster_down()
    CONFIG = cluster_up(5)
    for label, fn in CASES:
        for how in ("kill", "cut"):
            for trial in range(TRIALS):
                r = fn(how)
                uncut_node(3)
                r.update({"case": label, "how": how, "trial": trial})
                print(json.dumps(r), flush=True)
                results.append(r)
                # Leftovers of a torchrun that does not clean up end with the namespace.
                for i in range(1, 6):
                    kill_node(i)
                time.sleep(1)
finally:
    for i in range(1, 6):
        uncut_node(i)
    cluster_down()


def med(v):
    v = sorted(x for x in v if x is not None)
    return None if not v else v[len(v) // 2]


def fmt(x):
    return "-" if x is None else f"{x:.1f}"


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

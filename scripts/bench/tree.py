"""The launch tree's cost on the launch host (issue 21, items 3 and 5): N "remote" ssh nodes
that run on this machine, launched with the tree (--tree-width W) and without (--tree-width 0),
the two alternating within each round (the order swapped every round).

ssh is a fake first on PATH (scripts/bench/fake_ssh.c, compiled here): `ssh [opts] host cmd`
sleeps a handshake latency (FAKE_SSH_LATENCY_MS), burns a client CPU time (FAKE_SSH_CPU_MS),
logs whether an nrun agent or the launch host ran it, then becomes the command (the agent) on
this machine. Hosts are names (`fk0001`, ...) that are not this host, so nrun starts each over
ssh; nothing resolves them (ssh would, the fake does not), and every check nrun makes of a node
(its interfaces, the address it reached the store from, the ring of probes between nodes) runs
for real against the agents' own sockets on this machine.

Per run: wall; the coordinator's own CPU (its NRUN_LOG=debug getrusage line); its peak RSS
(GNU time %M); its most descriptors and the most ssh processes the launch host's spawner held
at once (sampled every 20 ms); how many ssh handshakes the launch host ran and how many the
inner agents did (the fake's log); exit code. Medians per size and mode as a markdown table;
raw runs as JSON lines to stderr.

Usage: tree.py RUNS SIZES [BINARY]    e.g. tree.py 3 64,256,1024 target/release/nrun
Environment: TREE_WIDTH (32), FAKE_SSH_LATENCY_MS (50), FAKE_SSH_CPU_MS (10), AGENT_TIMEOUT
(nrun's --agent-timeout, 5: a thousand "remote" agents on two cores can starve their own
liveness checks past it, which real nodes, each on its own host, do not).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nrun_stats import cpu_and_rss, run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def fake_ssh(dir):
    exe = os.path.join(dir, "ssh")
    subprocess.run(["gcc", "-O2", "-o", exe, os.path.join(HERE, "fake_ssh.c")], check=True)
    return exe


def hosts(n):
    return ",".join(f"fk{i:05d}" for i in range(n))


def children(pid):
    try:
        return [int(k) for k in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def comm(pid):
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def one(binary, n, width, dir):
    log = os.path.join(dir, "ssh.log")
    if os.path.exists(log):
        os.unlink(log)
    cmd = ["/usr/bin/time", "-f", "%e %M", binary, "-H", hosts(n), "--tree-width", str(width),
           "--join-timeout", "120", "--agent-timeout", os.environ.get("AGENT_TIMEOUT", "5"),
           "--no-python-probe", "--nproc", "1", "--no-python", "true"]
    env = dict(os.environ, NRUN_LOG="debug", PATH=dir + ":" + os.environ["PATH"],
               FAKE_SSH_LOG=log)
    env.setdefault("FAKE_SSH_LATENCY_MS", "50")
    env.setdefault("FAKE_SSH_CPU_MS", "10")
    most = {"fds": 0, "ssh": 0}
    found = [None]

    def look(timepid):
        # GNU time -> the keeper -> nrun (the coordinator) -> its spawner -> the ssh clients.
        if found[0] is None:
            for keeper in children(timepid):
                for k in children(keeper):
                    if comm(k) != "nr-watch":
                        found[0] = k
        nrun = found[0]
        if nrun is not None:
            most["fds"] = max(most["fds"], len(os.listdir(f"/proc/{nrun}/fd")))
            ssh = max((len(children(k)) for k in children(nrun)), default=0)
            most["ssh"] = max(most["ssh"], ssh)

    rc, err, wall = run(cmd, env, look)
    cpu, rss_kb = cpu_and_rss(err)
    here = inner = 0
    try:
        for line in open(log):
            if line.split()[-1] == "1":
                inner += 1
            else:
                here += 1
    except OSError:
        pass
    if rc != 0:
        print(err[:3000], file=sys.stderr)
    return {"n": n, "width": width, "wall_s": wall, "cpu_s": cpu,
            "rss_mib": rss_kb and rss_kb / 1024, "fds": most["fds"], "ssh_procs": most["ssh"],
            "handshakes_here": here, "handshakes_inner": inner, "rc": rc}


def main():
    runs = int(sys.argv[1])
    sizes = [int(s) for s in sys.argv[2].split(",")]
    binary = sys.argv[3] if len(sys.argv) > 3 else "target/release/nrun"
    width = int(os.environ.get("TREE_WIDTH", "32"))
    modes = [("tree", width), ("flat", 0)]
    res = {}
    with tempfile.TemporaryDirectory() as dir:
        fake_ssh(dir)
        for n in sizes:
            for r in range(runs):
                order = modes if r % 2 == 0 else modes[::-1]
                for name, w in order:
                    x = one(binary, n, w, dir)
                    x["mode"] = name
                    print(json.dumps(x), file=sys.stderr, flush=True)
                    res.setdefault((n, name), []).append(x)
    load = open("/proc/loadavg").read().split()[0]
    print(f"| nodes | mode | runs | ok | wall | nrun CPU | peak RSS | most fds | most ssh "
          f"procs | handshakes here / inner | (load {load}) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (n, name), xs in res.items():
        ok = [x for x in xs if x["rc"] == 0]

        def med(k):
            v = [x[k] for x in ok if x[k] is not None]
            return statistics.median(v) if v else float("nan")
        print(f"| {n} | {name} | {len(xs)} | {len(ok)} | {med('wall_s'):.2f} s "
              f"| {med('cpu_s'):.2f} s | {med('rss_mib'):.0f} MiB | {med('fds'):.0f} "
              f"| {med('ssh_procs'):.0f} | {med('handshakes_here'):.0f} / "
              f"{med('handshakes_inner'):.0f} | |")


if __name__ == "__main__":
    main()

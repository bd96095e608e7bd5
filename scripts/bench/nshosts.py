"""Namespace hosts for the recovery benchmarks (scripts/netns-cluster.sh; needs root): bring a
cluster up and down, find and kill a host's job processes, cut a host off, and read several
processes' output lines stamped with their arrival time. Shared by recovery.py and
succession.py."""

import os
import re
import socket
import subprocess
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def sh(cmd, check=True):
    return subprocess.run(cmd, shell=True, check=check, capture_output=True, text=True)


class Hosts:
    """Cluster NAME of K namespace hosts: rcv-h1 ... (each with its own address)."""

    def __init__(self, name, k, names_file=False):
        self.name = name
        sh(f"bash {ROOT}/scripts/netns-cluster.sh down {name}", check=False)
        out = sh(f"bash {ROOT}/scripts/netns-cluster.sh up {k} {name}").stdout.strip()
        self.config = out.splitlines()[-1]
        env = open(os.path.join(os.path.dirname(self.config), "cluster.env")).read()
        self.net = re.search(r"NRUN_CLUSTER_NET=(\d+)", env).group(1)
        self.k = k
        self.names_file = names_file
        if names_file:
            self.write_names()

    def host(self, i):
        return f"{self.name}-h{i}"

    def addr(self, i):
        return f"10.213.{self.net}.{10 + i}"

    def write_names(self):
        """Each host's /etc/hosts (ip netns exec mounts /etc/netns/NS/hosts) names every host's
        address, IPv4 and IPv4-mapped IPv6: torch's store client looks its peer's name up
        before it connects, and these hosts reach no DNS server (a 5 s stall per lookup). The
        machine's own host name (which `ip netns exec` keeps) names each host's own address:
        torchrun advertises it as its store's address."""
        lines = ["127.0.0.1 localhost", "::1 localhost", "::ffff:127.0.0.1 localhost"]
        for i in range(1, self.k + 1):
            lines += [f"{self.addr(i)} {self.host(i)}", f"::ffff:{self.addr(i)} {self.host(i)}"]
        me = socket.gethostname()
        for i in range(1, self.k + 1):
            d = f"/etc/netns/{self.host(i)}"
            os.makedirs(d, exist_ok=True)
            own = [f"{self.addr(i)} {me}", f"::ffff:{self.addr(i)} {me}"]
            open(f"{d}/hosts", "w").write("\n".join(own + lines) + "\n")

    def down(self):
        for i in range(1, self.k + 1):
            self.uncut(i)
            if self.names_file:
                sh(f"rm -rf /etc/netns/{self.host(i)}", check=False)
        sh(f"bash {ROOT}/scripts/netns-cluster.sh down {self.name}", check=False)

    def job_pids(self, i, needle=None):
        """Processes of the job in host i's namespace (not its sshd)."""
        out = []
        for p in sh(f"ip netns pids {self.host(i)}", check=False).stdout.split():
            try:
                cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "sshd" in cmd or not cmd:
                continue
            if needle is None or needle in cmd:
                out.append(p)
        return out

    def kill(self, i, sig="9"):
        pids = self.job_pids(i)
        if pids:
            sh(f"kill -{sig} " + " ".join(pids), check=False)
        return pids

    def cut(self, i):
        sh(f"ip netns exec {self.host(i)} sh -c "
           "'iptables -A INPUT -j DROP; iptables -A OUTPUT -j DROP'")

    def uncut(self, i):
        sh(f"ip netns exec {self.host(i)} sh -c 'iptables -F INPUT; iptables -F OUTPUT'",
           check=False)


class Watch:
    """Reads processes' stdout and stderr lines, each stamped with its arrival time and the
    process's label."""

    def __init__(self):
        self.lines = []
        self.lock = threading.Lock()

    def add(self, p, label=""):
        for stream in (p.stdout, p.stderr):
            threading.Thread(target=self.read, args=(stream, label), daemon=True).start()
        return p

    def read(self, stream, label):
        for line in stream:
            with self.lock:
                self.lines.append((time.time(), label, line.rstrip("\n")))

    def find(self, pattern, after=0.0):
        with self.lock:
            for t, label, line in self.lines:
                m = re.search(pattern, line)
                if m and t >= after:
                    return t, m, line, label
        return None

    def wait(self, pattern, timeout, after=0.0):
        end = time.time() + timeout
        while time.time() < end:
            got = self.find(pattern, after)
            if got:
                return got
            time.sleep(0.05)
        return None

    def tail(self, n=15):
        with self.lock:
            return [f"{label}: {line}" for _, label, line in self.lines[-n:]]


def popen(cmd, env=None):
    e = dict(os.environ, NCCL_NVLS_ENABLE="0", **(env or {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=e)


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


def med(v):
    v = sorted(x for x in v if x is not None)
    return None if not v else v[len(v) // 2]


def fmt(x):
    return "-" if x is None else f"{x:.1f}"

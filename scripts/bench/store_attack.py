#!/usr/bin/env python3
"""The store memory attacks of issue 35, measured: nrun's peak RSS (VmHWM) under each.

Usage: store_attack.py NRUN_BINARY [CONNECTIONS] [LIMIT_MIB]

Starts `NRUN_BINARY --master-port P --no-python sleep 600` (in a memory cgroup of LIMIT_MIB,
default 4096, where cgroups are writable, so that a runaway is killed instead of the machine),
then, each against a fresh nrun, from 127.0.0.2 (another "host"), with CONNECTIONS (default 8)
connections that never read their replies:

  append:    APPEND 1 MiB 512 times to one key (a 512 MiB value where nothing stops it), then
             4 pipelined GETs of it on each connection;
  get:       SET an 8 MiB value, 64 pipelined GETs of it on each connection;
  multi_get: SET an 8 MiB value, one MULTI_GET naming it 31 times (248 MiB) on each connection.

and, with connections spread over 127.0.0.2 to .5 (four "hosts", issue 46):

  half_sent:  VALIDATE, then a SET of 1 MiB one byte short, left unfinished;
  whole_idle: VALIDATE, then a whole SET of 1 MiB (one of 8 keys), then idle.

Usage for those: store_attack.py NRUN_BINARY CONNECTIONS LIMIT_MIB half_sent whole_idle
(the attacks to run may follow the limit; all five by default).

Prints one line per attack: nrun's peak RSS in MiB, whether nrun survived, and whether the
attacker's requests were refused (connections closed). The peak is read once it has not moved
for 3 s (at most 60 s).
"""

import os
import socket
import struct
import subprocess
import sys
import time

VALIDATE = b"\x00\xce\xf7\x85\x3c"


def b(x):
    return struct.pack("<Q", len(x)) + x


def req_set(k, v):
    return b"\x01" + b(k) + b(v)


def req_get(k):
    return b"\x03" + b(k)


def req_append(k, v):
    return b"\x09" + b(k) + b(v)


def req_multi_get(keys):
    return b"\x0a" + struct.pack("<Q", len(keys)) + b"".join(b(k) for k in keys)


def free_port():
    # Free on every address: nrun binds them all, and an earlier attack's sockets (127.0.0.2..,
    # their ports from the same range) may hold this one on theirs.
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def cgroup(limit_mib, kind):
    """A fresh memory cgroup's directory, or None."""
    name = f"nrun-bench-{os.getpid()}-{kind}"
    try:
        with open("/sys/fs/cgroup/cgroup.controllers") as f:
            v2 = "memory" in f.read().split()
    except OSError:
        v2 = False
    d, limit = (
        (f"/sys/fs/cgroup/{name}", "memory.max")
        if v2
        else (f"/sys/fs/cgroup/memory/{name}", "memory.limit_in_bytes")
    )
    try:
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/{limit}", "w") as f:
            f.write(str(limit_mib << 20))
        if not v2:
            with open(f"{d}/memory.swappiness", "w") as f:
                f.write("0")
        return d
    except OSError as e:
        print(f"# no memory cgroup ({e}): running without one", file=sys.stderr)
        return None


def nrun_pids(pid):
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(k) for k in f.read().split()]
    except OSError:
        pass
    return pids


def hwm_mib(pids):
    best = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        best = max(best, int(line.split()[1]) // 1024)
        except OSError:
            pass
    return best


def connect(port, src="127.0.0.2"):
    s = socket.socket()
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(VALIDATE)
    return s


def closed(s, within=2.0):
    """Whether the server closed `s` (reading nothing of any reply)."""
    s.settimeout(within)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def closed_now(s):
    """Whether the server has closed `s`, without waiting."""
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def rss_mib(pids):
    best = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        best = max(best, int(line.split()[1]) // 1024)
        except OSError:
            pass
    return best


def cgroup_peak_mib(d):
    for f in ["memory.peak", "memory.max_usage_in_bytes"]:
        try:
            with open(f"{d}/{f}") as fh:
                return int(fh.read().split()[0]) >> 20
        except (OSError, ValueError, IndexError):
            pass
    return 0


def settle(proc, seen):
    """nrun's peak once it has not moved for 3 s; `seen` keeps the highest read, so a peak
    before the kernel killed it still counts."""
    last, still = -1, time.time()
    end = time.time() + 60
    while time.time() < end and proc.poll() is None:
        now = max(hwm_mib(nrun_pids(proc.pid)), seen[0])
        seen[0] = now
        if now != last:
            last, still = now, time.time()
        elif time.time() - still > 3:
            break
        time.sleep(0.2)
    return last


def attack(nrun, kind, n, cg):
    port = free_port()
    pre = None
    if cg:
        procs = f"{cg}/cgroup.procs"

        def pre():
            with open(procs, "w") as f:
                f.write("0")

    proc = subprocess.Popen(
        [nrun, "--master-port", str(port), "--no-python", "sleep", "600"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=pre,
    )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    conns, refused = [], 0
    seen = [0]
    try:
        if kind in ("half_sent", "whole_idle"):
            for i in range(n):
                if i % 500 == 0:
                    print(f"# {kind}: {i} connections", file=sys.stderr, flush=True)
                if i % 50 == 0:
                    # Sampled while it grows: a peak before the kernel kills it still counts.
                    seen[0] = max(seen[0], hwm_mib(nrun_pids(proc.pid)))
                try:
                    c = connect(port, f"127.0.0.{2 + i % 4}")
                    c.settimeout(10)
                    if kind == "half_sent":
                        # One byte short of 1 MiB: the buffers nrun used to exempt.
                        c.sendall(req_set(f"/half/{i}".encode(), b"h" * ((1 << 20) - 64))[:-1])
                    else:
                        # Whole in 1 MiB (what a buffer kept after its request may hold).
                        c.sendall(req_set(f"/whole/{i % 8}".encode(), b"w" * ((1 << 20) - 64)))
                    conns.append(c)
                except OSError:
                    refused += 1
            settle(proc, seen)
            peak = seen[0]
            refused += sum(closed_now(c) for c in conns)
            alive = proc.poll() is None
            held = rss_mib(nrun_pids(proc.pid))
            print(f"# {kind}: nrun's RSS once settled {held} MiB", file=sys.stderr)
            return peak, alive, refused, cgroup_peak_mib(cg) if cg else 0
        setter = connect(port)
        if kind == "append":
            setter.sendall(req_set(b"/v", b""))
            for _ in range(512):
                try:
                    setter.sendall(req_append(b"/v", b"a" * (1 << 20)))
                except OSError:
                    break
        else:
            setter.sendall(req_set(b"/v", b"v" * (8 << 20)))
        seen[0] = max(seen[0], hwm_mib(nrun_pids(proc.pid)))
        try:
            # A GET on the setter's own connection: everything before it was served.
            setter.sendall(req_get(b"/v"))
            setter.settimeout(60)
            length = struct.unpack("<Q", setter.recv(8, socket.MSG_WAITALL))[0]
            got = 0
            while got < length:
                got += len(setter.recv(min(1 << 20, length - got)))
        except (OSError, struct.error):
            refused += 1
        setter.close()
        for _ in range(n):
            try:
                c = connect(port)
                if kind == "append":
                    c.sendall(req_get(b"/v") * 4)
                elif kind == "get":
                    c.sendall(req_get(b"/v") * 64)
                else:
                    c.sendall(req_multi_get([b"/v"] * 31))
                conns.append(c)
            except OSError:
                refused += 1
        settle(proc, seen)
        peak = seen[0]
        refused += sum(closed(c) for c in conns)
        alive = proc.poll() is None
    finally:
        for c in conns:
            c.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return peak, alive, refused, cgroup_peak_mib(cg) if cg else 0


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    nrun = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    kinds = sys.argv[4:] or ["append", "get", "multi_get", "half_sent", "whole_idle"]
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(hard, max(4096, 2 * n + 256))
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass
    for kind in kinds:
        cg = cgroup(limit, kind)
        try:
            peak, alive, refused, cg_peak = attack(nrun, kind, n, cg)
            print(
                f"{kind:10} {n} connections: nrun peak RSS {peak} MiB "
                f"(cgroup peak {cg_peak} MiB of {limit}), "
                f"{'alive' if alive else 'KILLED'}, {refused} refused"
            )
        finally:
            for _ in range(50):
                try:
                    if cg:
                        os.rmdir(cg)
                    break
                except OSError:
                    time.sleep(0.1)


if __name__ == "__main__":
    main()

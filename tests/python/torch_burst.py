"""N real torch TCPStore clients connect to one store at the same instant; prints one JSON line.

Usage: python torch_burst.py HOST PORT N [--each]

torch is imported once and the clients are forked from this process (N separate interpreters
importing torch would take minutes of CPU on a small machine), each blocked on a shared pipe
until all are ready. Each then times `TCPStore(HOST, PORT, is_master=False)` (connect, VALIDATE,
PING) from the common release instant, and keeps its connection open until every client has
reported, so the store holds all N at once as it would in a job. --each adds every client's time.
"""
import datetime
import json
import os
import sys
import time

import torch.distributed as dist


def main():
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    res_r, res_w = os.pipe()
    done_r, done_w = os.pipe()
    kids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            for fd in (go_w, ready_r, res_r, done_w):
                os.close(fd)
            os.write(ready_w, b"r")
            t0 = int.from_bytes(os.read(go_r, 8), "little")
            try:
                store = dist.TCPStore(host, port, is_master=False,
                                      timeout=datetime.timedelta(seconds=60))
                line = f"{i} {(time.monotonic_ns() - t0) / 1e6:.3f}\n"
            except Exception as e:  # noqa: BLE001 - reported, counted as failed
                store = None
                line = f"{i} failed {str(e).splitlines()[0][:200]}\n"
            os.write(res_w, line.encode())
            os.read(done_r, 1)  # hold the connection until every client has reported
            del store
            os._exit(0)
        kids.append(pid)
    for fd in (go_r, ready_w, res_w, done_r):
        os.close(fd)
    got = 0
    while got < n:
        b = os.read(ready_r, n - got)
        if not b:
            break
        got += len(b)
    t0 = time.monotonic_ns()
    os.write(go_w, t0.to_bytes(8, "little") * n)
    out = b""
    while out.count(b"\n") < n:
        b = os.read(res_r, 65536)
        if not b:
            break
        out += b
    os.close(done_w)
    for p in kids:
        os.waitpid(p, 0)
    ms, failed = [], []
    for line in out.decode().splitlines():
        i, rest = line.split(" ", 1)
        if rest.startswith("failed"):
            failed.append(rest)
        else:
            ms.append(float(rest))
    ms.sort()
    pick = lambda q: ms[min(len(ms) - 1, int(len(ms) * q))] if ms else None  # noqa: E731
    r = {"mode": "torch_burst", "n": n, "failed": len(failed) + n - len(ms) - len(failed),
         "median_ms": pick(0.5), "p90_ms": pick(0.9), "max_ms": ms[-1] if ms else None,
         "over_1s": sum(x > 1000 for x in ms)}
    if failed:
        r["first_failure"] = failed[0]
    if "--each" in sys.argv:
        r["each_ms"] = ms
    print(json.dumps(r), flush=True)


main()

"""The whole `nrun --preflight-only` of two nrun binaries, alternating on the same GPUs so that
the machine's noise falls on both alike: wall time start to verdict, and from each run's
--report the time of the largest size and of 8 bytes (out-of-place, the slower rank).

    preflight_ab.py RUNS NPROC PYTHON NAME=BINARY NAME=BINARY [-- extra nrun flags]
Prints one JSON line per run and a markdown table of medians.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def rows_of(doc):
    """The sweep's rows, wherever the report nests them."""
    if isinstance(doc, dict):
        if isinstance(doc.get("rows"), list) and doc["rows"] and "bytes" in doc["rows"][0]:
            return doc["rows"]
        for v in doc.values():
            r = rows_of(v)
            if r:
                return r
    elif isinstance(doc, list):
        for v in doc:
            r = rows_of(v)
            if r:
                return r
    return []


def main():
    runs, nproc, py = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rest = sys.argv[4:]
    extra = []
    if "--" in rest:
        i = rest.index("--")
        rest, extra = rest[:i], rest[i + 1:]
    bins = [a.split("=", 1) for a in rest]
    got = {name: [] for name, _ in bins}
    tmp = tempfile.mkdtemp()
    for i in range(runs):
        order = bins if i % 2 == 0 else bins[::-1]
        for name, path in order:
            report = os.path.join(tmp, f"{name}-{i}.json")
            cmd = [path, "--preflight-only", "--nproc", nproc, "--python", py, "--report", report] + extra
            t0 = time.perf_counter()
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            wall = (time.perf_counter() - t0) * 1000
            rows = []
            try:
                rows = rows_of(json.load(open(report)))
            except (OSError, ValueError):
                pass
            big = max(rows, key=lambda r: r["bytes"]) if rows else None
            small = min(rows, key=lambda r: r["bytes"]) if rows else None
            rec = {"name": name, "run": i, "rc": r.returncode, "wall_ms": round(wall, 1),
                   "big_bytes": big and big["bytes"],
                   "big_us": big and big["out_of_place"]["time_us"],
                   "big_busbw": big and big["out_of_place"]["busbw_gbs"],
                   "small_us": small and small["out_of_place"]["time_us"]}
            print(json.dumps(rec), flush=True)
            if r.returncode != 0:
                print(r.stderr[-2000:], file=sys.stderr)
            got[name].append(rec)
    print("\n| binary | runs ok | wall (median) | largest size: time | busbw | 8 B: time |")
    print("|---|---|---|---|---|---|")
    for name, recs in got.items():
        ok = [r for r in recs if r["rc"] == 0]
        med = lambda k: statistics.median([r[k] for r in ok if r[k] is not None]) if ok else float("nan")
        print(f"| {name} | {len(ok)}/{len(recs)} | {med('wall_ms'):.0f} ms | {med('big_us'):.1f} us "
              f"| {med('big_busbw'):.1f} GB/s | {med('small_us'):.1f} us |")


main()

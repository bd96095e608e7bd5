"""Turns a bench-results/*.jsonl file into the markdown tables of BENCHMARKS.md."""
import json
import statistics
import sys
from collections import defaultdict

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
meta = next((r["meta"] for r in rows if "meta" in r), {})
print(f"Run {meta.get('date')} on {meta.get('host')}: {meta.get('cpus')} CPUs ({meta.get('cpu')}), "
      f"{meta.get('mem_gib')} GiB, Linux {meta.get('kernel')}; nrun {meta.get('nrun')}, "
      f"torch {meta.get('torch')}, {meta.get('mpirun')}\n")

print("| launcher (8 x true) | runs | median wall | min wall | median peak memory |")
print("|---|---|---|---|---|")
for r in rows:
    if r.get("label", "").startswith("launch/"):
        print(f"| {r['label'][7:]} | {r['runs']} | {r.get('median_wall_ms', '-')} ms | "
              f"{r.get('min_wall_ms', '-')} ms | {r.get('median_peak_mib', '-')} MiB |")

cl = [r for r in rows if r.get("label", "").startswith("cluster")]
if cl:
    print("\n| launch over ssh (K hosts x 2 x true) | runs | median wall | min wall | exit codes |")
    print("|---|---|---|---|---|")
    for r in cl:
        print(f"| {r['label']} | {r['runs']} | {r.get('median_wall_ms', '-')} ms | {r.get('min_wall_ms', '-')} ms | "
              f"{','.join(r['exit_codes'])}{' (timed out after %ss)' % r['timed_out_after_s'] if 'timed_out_after_s' in r else ''} |")

bs = [r for r in rows if r.get("label", "").startswith("bisect")]
if bs:
    print("\n| bisect, one bad node among N | wall | rounds (after stage 1) | named | exit |")
    print("|---|---|---|---|---|")
    for r in bs:
        print(f"| N={r['label'][6:]} | {r['wall_ms'] / 1000:.1f} s | {r['rounds']} ({r['rounds_after_stage1']}) | "
              f"{', '.join(r['named'])} (expected {r['expected']}) | {r['exit_code']} |")

ws = [r for r in rows if r.get("label", "").startswith("watch")]
if ws:
    print("\n| watch | result |")
    print("|---|---|")
    for r in ws:
        rest = {k: v for k, v in r.items() if k != "label"}
        print(f"| {r['label']} | {', '.join(f'{k} {v:.3f}' if isinstance(v, float) else f'{k} {v}' for k, v in rest.items())} |")

groups = defaultdict(list)
for r in rows:
    lab = r.get("label", "")
    if "/" in lab and not lab.startswith(("launch/", "cluster", "bisect", "watch")):
        groups[lab].append(r)


def med(rs, key):
    v = [r["result"][key] for r in rs if "result" in r]
    return statistics.median(v) if v else None


def timed_out(rs):
    return next((r["timed_out_after_s"] for r in rs if "timed_out_after_s" in r), None)


print("\n| store case | server | runs | median | p90 | max |")
print("|---|---|---|---|---|---|")
for lab, rs in groups.items():
    case, server = lab.split("/", 1)
    ok = [r for r in rs if "result" in r]
    t = timed_out(rs)
    if case == "rtt":
        print(f"| SET+GET round trip | {server} | {len(ok)} | {med(rs, 'median_us'):.1f} us | "
              f"{med(rs, 'p90_us'):.1f} us | p99 {med(rs, 'p99_us'):.1f} us |")
    elif case.startswith("torchburst"):
        # torchburstN: real torch clients, their reverse lookup of the store's address asked of
        # the host's DNS; torchburstN-localptr: answered from /etc/hosts (BENCHMARKS.md, 11).
        n, _, how = case[10:].partition("-")
        how = "PTR answered by /etc/hosts" if how else "PTR asked of DNS"
        if ok:
            fails = sum(r["result"]["failed"] for r in ok)
            over = statistics.median(r["result"]["over_1s"] for r in ok)
            print(f"| {n} torch clients at once ({how}): connect | {server} | {len(ok)} | "
                  f"{med(rs, 'median_ms'):.1f} ms | {med(rs, 'p90_ms'):.1f} ms | {med(rs, 'max_ms'):.1f} ms "
                  f"({over:g} over 1 s){' (%d failed)' % fails if fails else ''} |")
        if t:
            print(f"| {n} torch clients at once ({how}): connect | {server} | {len(rs) - len(ok)} | > {t} s (timed out) | | |")
    elif case.startswith("burst"):
        n = case[5:]
        if ok:
            fails = sum(r["result"]["failed"] for r in ok)
            print(f"| burst of {n} processes: admission | {server} | {len(ok)} | {med(rs, 'median_ms'):.1f} ms | "
                  f"{med(rs, 'p90_ms'):.1f} ms | {med(rs, 'max_ms'):.1f} ms{' (%d failed)' % fails if fails else ''} |")
        if t:
            print(f"| burst of {n} processes: admission | {server} | {len(rs) - len(ok)} | > {t} s (timed out) | | |")
    elif case.startswith("rendezvous"):
        n = case[10:]
        if ok:
            secs = sorted(r["result"]["secs"] for r in ok)
            errs = sum(r["result"]["errors"] for r in ok)
            print(f"| rendezvous of {n} clients: total | {server} | {len(ok)} | {statistics.median(secs):.3f} s | | "
                  f"{secs[-1]:.3f} s{' (%d client errors)' % errs if errs else ''} |")
        if t:
            print(f"| rendezvous of {n} clients: total | {server} | {len(rs) - len(ok)} | > {t} s (timed out) | | |")

"""Step time under launchers, alternating their order every round (a first-in-round bias was
seen before): `python3 ledger_ab.py ROUNDS NAME=CMD...`, each CMD a shell line that runs
step_worker.py and lets rank 0's `STEP_US` line through. Prints each launcher's median step time
and its ratio to the first's: the ratio of the medians, and the median of the rounds' own ratios
with its 95% interval (bootstrap), which takes out the machine's drift between rounds."""
import random, re, statistics, subprocess, sys

rounds = int(sys.argv[1])
runs = [a.split("=", 1) for a in sys.argv[2:]]
got = {name: {} for name, _ in runs}
for r in range(rounds):
    order = runs if r % 2 == 0 else runs[::-1]
    for name, cmd in order:
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True)
        m = re.search(r"STEP_US (\S+)", out.stdout)
        if out.returncode != 0 or not m:
            print(f"{name}: rc={out.returncode}\n{out.stderr[-2000:]}", flush=True)
            continue
        got[name][r] = float(m.group(1))
        print(f"round {r} {name}: {m.group(1)} us", flush=True)
first = runs[0][0]
base = statistics.median(got[first].values())
rng = random.Random(1)
for name, _ in runs:
    med = statistics.median(got[name].values())
    ratios = [got[name][r] / got[first][r] for r in got[name] if r in got[first]]
    boot = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000)
    )
    lo, hi = boot[50], boot[1949]
    print(
        f"{name}: median step {med:.1f} us over {len(got[name])} runs, ratio {med / base:.4f}; "
        f"paired ratio {statistics.median(ratios):.4f} (95% {lo:.4f}-{hi:.4f})"
    )

"""Step time under launchers, alternating their order every round (a first-in-round bias was
seen before): `python3 ledger_ab.py ROUNDS NAME=CMD...`, each CMD a shell line that runs
step_worker.py and lets rank 0's `STEP_US` line through. Prints each launcher's median step time
and its ratio to the first's."""
import re, statistics, subprocess, sys

rounds = int(sys.argv[1])
runs = [a.split("=", 1) for a in sys.argv[2:]]
got = {name: [] for name, _ in runs}
for r in range(rounds):
    order = runs if r % 2 == 0 else runs[::-1]
    for name, cmd in order:
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True)
        m = re.search(r"STEP_US (\S+)", out.stdout)
        if out.returncode != 0 or not m:
            print(f"{name}: rc={out.returncode}\n{out.stderr[-2000:]}", flush=True)
            continue
        got[name].append(float(m.group(1)))
        print(f"round {r} {name}: {m.group(1)} us", flush=True)
base = statistics.median(got[runs[0][0]])
for name, _ in runs:
    med = statistics.median(got[name])
    print(f"{name}: median step {med:.1f} us over {len(got[name])} runs, ratio {med / base:.4f}")

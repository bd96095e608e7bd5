"""A worker that prints a numbered line every 10 ms until it is stopped (a training loop's
log): `nrun ... | head -2` finds the pipe closed on its next line."""
import os
import sys
import time

rank = os.environ["RANK"]
with open(os.environ["MARK"], "a") as m:
    m.write("ready\n")
i = 0
while True:
    i += 1
    print(f"rank {rank} line {i}", flush=True)
    time.sleep(0.01)

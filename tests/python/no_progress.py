"""A program that fails on rank 1 at a step its mode sets, printing "step N" before each step
(tests/no_progress.rs). Modes: same (step 5, ValueError, every attempt), more (step 5, 7, 9, ...:
more progress each attempt), other (step 5, ValueError and KeyError in turn). Rank 1 prints its
traceback and exits 3; the other ranks stop at that step and wait to be stopped, so that the
progress read is the same whatever the timing."""
import os
import sys
import time
import traceback

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
mode = sys.argv[1]
fail_at = 5 + 2 * attempt if mode == "more" else 5
error = KeyError if mode == "other" and attempt % 2 else ValueError


def train_step(step):
    if rank == 1 and step == fail_at:
        raise error(f"bad batch at step {step}")


for step in range(fail_at + 1):
    print(f"step {step}", flush=True)
    try:
        train_step(step)
    except Exception:
        traceback.print_exc()
        sys.exit(3)
while True:
    time.sleep(60)

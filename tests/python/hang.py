"""A gloo training loop that goes wrong in one of several ways, chosen by NRUN_HANG_CASE:

- sleep:     rank 1 sleeps instead of entering the 6th all_reduce
- early:     rank 1 leaves its loop after 5 steps (one collective fewer) and exits
- gather:    rank 1 calls all_gather where the others call all_reduce
- timeout:   as `sleep`, with a collective timeout of NRUN_HANG_TIMEOUT_S (default 8) seconds
- straggler: rank 2 is 0.5 s slower per step; the job ends after NRUN_STEPS steps
- pause:     every rank pauses NRUN_PAUSE_S seconds (a checkpoint), then the job ends
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

case = os.environ.get("NRUN_HANG_CASE", "sleep")
timeout = float(os.environ.get("NRUN_HANG_TIMEOUT_S", "600"))
# NRUN_HANG_BACKEND=nccl: the same on GPUs, where a rank stuck behind an all_reduce waits at
# its next sync (the .item() below).
backend = os.environ.get("NRUN_HANG_BACKEND", "gloo")
dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()) if backend == "nccl" else None
steps = int(os.environ.get("NRUN_STEPS", "1000000"))


def stuck_forever():
    print(f"stalled at {time.time():.3f}", flush=True)
    time.sleep(3600)


def checkpoint():
    time.sleep(float(os.environ.get("NRUN_PAUSE_S", "8")))


# straggler: rank 2 sleeps NRUN_SLOW_S (0.55) per step, the others NRUN_BASE_S (0.05).
slow_s = float(os.environ.get("NRUN_SLOW_S", "0.55"))
base_s = float(os.environ.get("NRUN_BASE_S", "0.05"))
# size: from the 6th all_reduce on, rank 1 reduces 4x as many elements as the others.
# restart (kept below the lines above, whose numbers tests check): in the first attempt rank 1
# fails after 3 steps; the restarted group goes on as `sleep`.
if case == "restart":
    case = "fail" if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else "sleep"
    print(f"rank {os.environ['RANK']} pid {os.getpid()} case {case}", flush=True)

# poll: rank 1 polls instead of entering the 6th all_reduce (a loop of short sleeps, so its
# stack keeps moving while its peers wait).
def poll_forever():
    print(f"polling at {time.time():.3f}", flush=True)
    while True:
        time.sleep(1)


t = torch.ones(1024, device=device)
for step in range(steps):
    if step == 5 and rank == 1 and case == "poll":
        poll_forever()
    if step == 5 and rank == 1 and case in ("sleep", "timeout"):
        stuck_forever()
    if step == 3 and rank == 1 and case == "fail":
        raise SystemExit("rank 1 fails on purpose")
    if step == 5 and rank == 1 and case == "early":
        # Out at once: with the whole teardown, interpreter shutdown on a loaded machine can
        # outlast nrun's settling time after the peers fail, and a rank stopped by nrun cannot
        # be told from one that would have exited 0.
        print(f"rank {rank}: leaves early", flush=True)
        os._exit(0)
    if step == 5 and rank == 1 and case == "gather":
        out = [torch.zeros(1024, device=device) for _ in range(world)]
        dist.all_gather(out, t)
        continue
    if step == 5 and rank == 1 and case == "size":
        t = torch.ones(4096, device=device)
    if step == 5 and case == "pause":
        checkpoint()
    if case == "straggler":
        time.sleep(slow_s if rank == 2 else base_s)
    else:
        time.sleep(0.05)
    dist.all_reduce(t)
    if backend == "nccl":
        t[0].item()
    if step == 10 and os.environ.get("MARK"):
        # A marker for tests that act once training runs (not after a guess at start-up time).
        with open(os.environ["MARK"], "a") as f:
            f.write("training\n")
    if case == "pause" and step == 8:
        break
print(f"rank {rank}: done", flush=True)
dist.destroy_process_group()

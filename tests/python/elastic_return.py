"""A job that runs until it is whole again: for an elastic job whose node is lost and comes back.

Every attempt: init_process_group("gloo") through the launcher's store, an all_reduce that must
sum the world's ranks, then one line "up world=W restart=R" appended to $MARK (what the test
waits on) and "W R <start> <ready>" to $MARK.times (seconds since the epoch: when this script
started, and when its all_reduce was done). The attempt that has the full world ($FULL_WORLD)
after a restart ends the job (exit 0); every other attempt waits to be stopped (the launcher
restarts the group when a node is lost or joins).
"""

import os
import time

start = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.full((16,), float(rank + 1))
dist.all_reduce(t)
assert torch.all(t == world * (world + 1) / 2), f"rank {rank}: all_reduce gave {t[:2]}"
ready = time.time()
with open(os.environ["MARK"] + ".times", "a") as f:
    f.write(f"{world} {restart} {start:.3f} {ready:.3f}\n")
with open(os.environ["MARK"], "a") as f:
    f.write(f"up world={world} restart={restart}\n")
if world == int(os.environ["FULL_WORLD"]) and restart > 0:
    dist.barrier()
    dist.destroy_process_group()
else:
    while True:
        time.sleep(1)

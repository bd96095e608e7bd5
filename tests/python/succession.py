"""A job that trains until it is whole again under a new rendezvous host (tests/succession.rs).

Every attempt: init_process_group("gloo") through the launcher's store, an all_reduce that must
sum the world's ranks, then one line "up world=W master=ADDR" appended to $MARK (what the test
waits on) and "W ADDR <start> <ready>" to $MARK.times (seconds since the epoch: when this script
started, and when its all_reduce was done). Then it trains: an all_reduce every 0.2 s, rank 0
appending "step W ADDR <t>" to $MARK.steps after each (what tells which world trained when).
The attempt that has the full world ($FULL_WORLD) under a host other than the first
($FIRST_MASTER) ends the job (exit 0) after a few steps; every other attempt trains until it is
stopped (the launcher restarts the group when a node is lost or joins).
"""

import os
import time

start = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
master = os.environ["MASTER_ADDR"]
t = torch.full((16,), float(rank + 1))
dist.all_reduce(t)
assert torch.all(t == world * (world + 1) / 2), f"rank {rank}: all_reduce gave {t[:2]}"
ready = time.time()
with open(os.environ["MARK"] + ".times", "a") as f:
    f.write(f"{world} {master} {start:.3f} {ready:.3f}\n")
with open(os.environ["MARK"], "a") as f:
    f.write(f"up world={world} master={master}\n")
done = world == int(os.environ["FULL_WORLD"]) and master != os.environ["FIRST_MASTER"]
steps = 0
while not done or steps < 5:
    t = torch.ones(16)
    dist.all_reduce(t)
    if rank == 0:
        with open(os.environ["MARK"] + ".steps", "a") as f:
            f.write(f"step {world} {master} {time.time():.3f}\n")
    steps += 1
    time.sleep(0.2)
dist.barrier()
dist.destroy_process_group()

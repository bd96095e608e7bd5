"""A gloo job that joins, says so, waits for $GO (the test's attack on the store has run), then
uses the store and the group: what a job does while strangers hold the store's memory or fill it.

Each rank sets a key of a few KiB and reads its neighbour's, then all_reduce and a barrier.
"""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
with open(os.environ["MARK"], "a") as f:
    f.write("started\n")
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.1)
store = dist.distributed_c10d._get_default_store()
store.set(f"after/{rank}", f"{rank}" * 3000)
peer = (rank + 1) % world
assert store.get(f"after/{peer}") == f"{peer}".encode() * 3000
t = torch.ones(1024)
dist.all_reduce(t)
assert torch.all(t == world)
dist.barrier()
print(f"rank {rank}/{world}: store and group ok", flush=True)
dist.destroy_process_group()

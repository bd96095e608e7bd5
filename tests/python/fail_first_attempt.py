"""Attempt 0: rendezvous, then rank 1 dies. Attempt 1: rendezvous again and all_reduce."""
import os
import sys

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
if attempt == 0:
    dist.barrier()
    if rank == 1:
        sys.exit(1)
    dist.barrier()  # rank 1 is gone: nrun stops this one
t = torch.ones(4) * (rank + 1)
dist.all_reduce(t)
assert torch.all(t == 3), t
if rank == 0:
    print(f"attempt {attempt} all_reduce ok", flush=True)
dist.destroy_process_group()

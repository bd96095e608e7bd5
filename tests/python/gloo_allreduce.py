"""init_process_group("gloo") through the launcher's store, then all_reduce and a barrier.

Each rank contributes rank+1 in every element; the sum must be W*(W+1)/2 everywhere. Also checks
that the worker environment matches what torchrun sets.
"""

import os

import torch
import torch.distributed as dist

for var in ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING"]:
    assert var in os.environ, f"{var} missing from the worker environment"
assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
t = torch.full((1024,), float(rank + 1))
dist.all_reduce(t)
expect = world * (world + 1) / 2
assert torch.all(t == expect), f"rank {rank}: all_reduce gave {t[:4]}, expected {expect}"
dist.barrier()
print(f"rank {rank}/{world}: all_reduce ok ({expect:.0f})", flush=True)
dist.destroy_process_group()

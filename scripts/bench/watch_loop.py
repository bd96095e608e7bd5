"""A fixed gloo training loop for measuring the watch's cost: each step a little compute and an
all_reduce. Rank 0 prints `step_ms X`, the slowest rank's median step time."""

import os
import statistics
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
torch.set_num_threads(1)
steps = int(os.environ.get("STEPS", "300"))
a = torch.randn(192, 192)
g = torch.randn(1 << 16)
times = []
for _ in range(steps):
    t = time.perf_counter()
    for _ in range(4):
        a = torch.tanh(a @ a * 0.01)
    dist.all_reduce(g)
    times.append(time.perf_counter() - t)
m = torch.tensor([statistics.median(times[10:]) * 1e3])
dist.all_reduce(m, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    print(f"step_ms {m.item():.3f}", flush=True)
dist.destroy_process_group()

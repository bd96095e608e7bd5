"""An NCCL training-like loop for the GPU checks: each step NRUN_MM matrix products of 4096x4096
(NRUN_SLOW_MM on rank NRUN_SLOW_RANK, default 1: a straggler), an all_reduce of 4 MiB, and a
sync (.item()), for NRUN_SECONDS seconds. Prints the median step time at the end."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
mm = int(os.environ.get("NRUN_MM", "6"))
if rank == int(os.environ.get("NRUN_SLOW_RANK", "1")):
    mm = int(os.environ.get("NRUN_SLOW_MM", str(mm)))
a = torch.randn(4096, 4096, device="cuda")
t = torch.ones(1 << 20, device="cuda")
end = time.monotonic() + float(os.environ.get("NRUN_SECONDS", "60"))
times = []
stop = torch.zeros(1, device="cuda")
while True:
    t0 = time.perf_counter()
    for _ in range(mm):
        b = a @ a
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # Every rank stops at the same step: the first to run out of time decides.
    stop.fill_(float(time.monotonic() > end))
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    done = stop.item() > 0
    times.append(time.perf_counter() - t0)
    if done:
        break
s = sorted(times[5:])
print(f"rank {rank}: {len(times)} steps, median step {1e3 * s[len(s) // 2]:.2f} ms", flush=True)
dist.destroy_process_group()

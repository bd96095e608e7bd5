"""torch.distributed.all_reduce over the preflight's sizes, timed like the preflight: per size,
warm-up, then ITERS back-to-back all-reduces between two CUDA events; the slowest rank's time.
Run under a launcher (nrun --no-preflight, or torchrun). Rank 0 prints one JSON line per size.

    torch_allreduce.py [MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP]
"""
import json
import os
import sys
import time

t_start = time.monotonic()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

mn, mx, factor, iters, warmup = (int(x) for x in (sys.argv[1:6] if len(sys.argv) > 5 else [8, 256 << 20, 2, 20, 5]))
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
t_import = time.monotonic()
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
rank, world = dist.get_rank(), dist.get_world_size()
buf = torch.ones(mx // 4, dtype=torch.float32, device="cuda")
dist.all_reduce(buf[:1])
torch.cuda.synchronize()
t_ready = time.monotonic()
if rank == 0:
    print(json.dumps({"import_s": t_import - t_start, "init_and_first_allreduce_s": t_ready - t_import,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())), "torch": torch.__version__}), flush=True)
size = mn
while size <= mx:
    n = size // 4
    x = buf[:n]
    for _ in range(warmup):
        dist.all_reduce(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        dist.all_reduce(x)
    e.record()
    e.synchronize()
    us = torch.tensor([s.elapsed_time(e) * 1e3 / iters], device="cuda")
    dist.all_reduce(us, op=dist.ReduceOp.MAX)
    if rank == 0:
        algbw = size / (us.item() * 1e-6) / 1e9
        busbw = algbw * 2 * (world - 1) / world
        print(json.dumps({"bytes": size, "time_us": us.item(), "algbw": algbw, "busbw": busbw}), flush=True)
    size *= factor
dist.destroy_process_group()

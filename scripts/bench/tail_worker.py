"""A training step for step-time tails (step_tail.py): TAIL_MM matrix products of TAIL_N x TAIL_N,
an all-reduce of TAIL_AR_MB MiB, and a sync, TAIL_STEPS times (defaults: the watch issue's 4 x 2048, 16 MiB, 600 steps).
NCCL on a GPU, gloo on the CPU (TAIL_N defaults to 256 there). Each rank writes its steps to
$TAIL_DIR/rank<R>: one line per step, its start (wall clock, s) and its duration (s), timed inside
the worker, so that a launcher's cost shows as the steps it slows, not as a median."""
import os, time
import torch, torch.distributed as dist

cuda = torch.cuda.is_available() and os.environ.get("TAIL_CPU") != "1"
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
dev = torch.device("cuda") if cuda else torch.device("cpu")
n = int(os.environ.get("TAIL_N", "2048" if cuda else "256"))
mm = int(os.environ.get("TAIL_MM", "4"))
steps = int(os.environ.get("TAIL_STEPS", "600"))
a = torch.randn(n, n, device=dev)
g = torch.ones((int(float(os.environ.get("TAIL_AR_MB", "16")) * (1 << 20))) // 4, device=dev)
rows = []
for i in range(steps):
    w0, t0 = time.time(), time.perf_counter()
    for _ in range(mm):
        b = a @ a
    dist.all_reduce(g)
    if cuda:
        torch.cuda.synchronize()
    rows.append((w0, time.perf_counter() - t0))
dist.barrier()
out = os.environ.get("TAIL_DIR")
if out:
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.writelines(f"{w:.6f} {d:.6f}\n" for w, d in rows)
dist.destroy_process_group()

"""A training-like loop for step-time comparisons (ledger_ab.py): a matmul and an NCCL (or gloo)
all-reduce per step, one output line per step (the launcher's relay and the ledger's per-line
hook are on that path; PRINT=0: none, to see the launcher without its relay). Rank 0 prints
`STEP_US <median of steps 50..>` at the end."""
import os, sys, time
import torch, torch.distributed as dist

steps = int(os.environ.get("STEPS", "1500"))
print_steps = os.environ.get("PRINT", "1") != "0"
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
n = 2048 if cuda else 256
a = torch.randn(n, n, device=dev)
g = torch.randn(1 << 20, device=dev)
times = []
for i in range(steps):
    t0 = time.perf_counter()
    b = a @ a
    dist.all_reduce(g)
    if cuda:
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    if print_steps:
        print(f"step {i} loss {float(b[0, 0]):.3f}", flush=True)
dist.barrier()
if dist.get_rank() == 0:
    t = sorted(times[50:])
    print(f"STEP_US {t[len(t) // 2] * 1e6:.1f}", flush=True)
dist.destroy_process_group()

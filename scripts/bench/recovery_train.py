"""A gloo DDP training loop at about 10 steps/s for measuring recovery from a lost node. Rank 0
prints `start restart R t=...` as its process starts (before torch is imported) and `step N
world W restart R t=... master=ADDR` after every step (MASTER_ADDR: which host's store the
world formed at); the loop ends after SECONDS_TO_RUN seconds of steps."""

import time

T0 = time.time()
import os  # noqa: E402

RANK = os.environ.get("RANK", "0")
RESTART = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
MASTER = os.environ.get("MASTER_ADDR", "-")
if RANK == "0":
    print(f"start restart {RESTART} t={T0:.3f}", flush=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

dist.init_process_group("gloo", init_method="env://")
torch.set_num_threads(1)
world = dist.get_world_size()
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256)
end = time.time() + float(os.environ.get("SECONDS_TO_RUN", "25"))
step = 0
while time.time() < end:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    step += 1
    if RANK == "0":
        print(f"step {step} world {world} restart {RESTART} t={time.time():.3f} master={MASTER}",
              flush=True)
    time.sleep(0.1)
dist.destroy_process_group()

"""A small DistributedDataParallel training: NCCL on GPUs, gloo on CPU.

    nrun --nproc 4 examples/train.py [--steps N] [--batch N] [--lr LR]

Each rank trains the same tiny regression model on its own shard of synthetic data; DDP
averages gradients. Rank 0 prints the loss; every rank checks at the end that its parameters
equal rank 0's (DDP keeps replicas identical), so a wrong all-reduce fails loudly.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


@record
def main():
    t_start = time.monotonic()
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    args = p.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"backend={backend} world_size={world} device={device.type} lr={args.lr} "
              f"init {time.monotonic() - t_start:.2f}s after start", flush=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.arange(16, dtype=torch.float32) / 16

    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=g)
        y = (x @ w_true).unsqueeze(1) + 0.01 * torch.randn(args.batch, 1, generator=g)
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0 and rank == 0:
            print(f"first step done {time.monotonic() - t_start:.2f}s after start", flush=True)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {loss.item():.4f}", flush=True)

    # Replicas must be identical after DDP training.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    if not torch.equal(flat, ref):
        raise RuntimeError(f"rank {rank}: parameters differ from rank 0 after DDP training")
    dist.barrier()
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks, final loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
r = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(r)
t = torch.ones(1 << 20, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize()
dist.destroy_process_group()

"""Rank 0 ends its script (exit 0); rank 1 raises a ValueError once rank 0 is gone (its pid
through the store, its end seen when the pid is no more): a clean exit before a rank's own
exception."""
import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
if dist.get_rank() == 0:
    store.set("rank0_pid", str(os.getpid()))
    print("rank 0: done", flush=True)
else:
    pid = int(store.get("rank0_pid"))
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    raise ValueError("rank 1 cannot go on")

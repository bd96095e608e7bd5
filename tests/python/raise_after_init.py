"""Rank 1 raises after init_process_group, whose excepthook prefixes each line with [rank1]: ."""
import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if os.environ["RANK"] == "1":
    raise ValueError("rank 1 cannot go on")
time.sleep(60)

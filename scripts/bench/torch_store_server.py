"""Hosts PyTorch's own TCPStore server for the benchmarks; prints its port, serves until killed.
Usage: python torch_store_server.py libuv|legacy"""
import datetime
import resource
import signal
import sys

import torch.distributed as dist

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
backend = sys.argv[1] if len(sys.argv) > 1 else "libuv"
store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=600), use_libuv=(backend == "libuv"))
print(store.port, flush=True)
signal.pause()

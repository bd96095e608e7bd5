"""Says what a worker's stdout and stderr are: a terminal (and its size) or not, as tqdm,
rich and Python's own colours see them; draws a tqdm bar where tqdm is installed."""
import os
import sys

rank = os.environ["RANK"]
for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
    fd = stream.fileno()
    size = tuple(os.get_terminal_size(fd)) if stream.isatty() else None
    print(f"rank {rank} {name} tty={stream.isatty()} size={size}", file=stream, flush=True)
try:
    from tqdm import tqdm
except ImportError:
    print(f"rank {rank} has no tqdm", flush=True)
else:
    for _ in tqdm(range(3), mininterval=0, desc=f"bar{rank}"):
        pass

# Rank 0 stops in pdb; the others go on. With nrun's stdin on rank 0, a user answers pdb.
import os

answer = 1
if os.environ["RANK"] == "0":
    breakpoint()
print(f"rank {os.environ['RANK']} after the breakpoint", flush=True)

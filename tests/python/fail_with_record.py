"""Rank 1 raises inside a function decorated with torch's @record (error file traceback)."""
import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 cannot go on")
    time.sleep(60)


if __name__ == "__main__":
    main()

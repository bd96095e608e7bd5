# Each rank says it is ready, then sleeps (past pty_drive.py's hang guard): a job to interrupt.
import os
import time

print(f"rank {os.environ['RANK']} ready", flush=True)
time.sleep(600)

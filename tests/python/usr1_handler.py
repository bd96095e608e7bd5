# Each rank marks that its SIGUSR1 handler is installed, waits for the signal (two minutes at
# most: a hang guard, as the signal is sent once every rank is ready), and says so.
import os
import signal
import time

got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
with open(os.environ["MARK"], "a") as f:
    f.write("ready\n")
t = time.time()
while not got and time.time() - t < 120:
    time.sleep(0.05)
print(f"rank {os.environ['RANK']} handled SIGUSR1: {bool(got)}", flush=True)
with open(os.environ["MARK"], "a") as f:
    f.write(f"handled {bool(got)}\n")

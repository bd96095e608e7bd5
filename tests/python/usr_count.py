# Each rank counts the SIGUSR1 and SIGUSR2 it gets until SIGTERM (nrun stopping the job) and says
# how many: a signal passed on twice shows as x2. Standard signals pending together are taken
# lowest first, so a copy nrun sent before its SIGTERM is counted. Two minutes at most: a hang
# guard.
import os
import signal
import time

sigs = {signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM}
signal.pthread_sigmask(signal.SIG_BLOCK, sigs)


def mark(line):
    with open(os.environ["MARK"], "a") as f:
        f.write(line + "\n")


mark("ready")
n = {signal.SIGUSR1: 0, signal.SIGUSR2: 0}
t = time.time()
while time.time() - t < 120:
    i = signal.sigtimedwait(sigs, 1)
    if i is None:
        continue
    if i.si_signo == signal.SIGTERM:
        break
    n[i.si_signo] += 1
    mark(f"got {signal.Signals(i.si_signo).name}")
rank = os.environ["RANK"]
print(f"rank {rank}: SIGUSR1 x{n[signal.SIGUSR1]}, SIGUSR2 x{n[signal.SIGUSR2]}", flush=True)

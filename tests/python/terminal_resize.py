"""Waits for its terminal to be resized to WANT (COLSxROWS, both streams), as a curses or rich
program at a terminal does: says "rank R resize-ready" once its SIGWINCH handler is in, then looks at
each SIGWINCH; says "rank R resized to (C, R) on SIGWINCH" on the one that brings WANT, or
"rank R never resized" after a minute."""
import os
import signal
import sys
import threading

rank = os.environ["RANK"]
want = tuple(int(v) for v in os.environ["WANT"].split("x"))
winch = threading.Event()
signal.signal(signal.SIGWINCH, lambda *_: winch.set())


def sizes():
    return [tuple(os.get_terminal_size(s.fileno())) for s in (sys.stdout, sys.stderr)]


print(f"rank {rank} resize-ready", flush=True)
while winch.wait(60):
    winch.clear()
    if sizes() == [want, want]:
        print(f"rank {rank} resized to {want} on SIGWINCH", flush=True)
        sys.exit(0)
print(f"rank {rank} never resized: {sizes()}", flush=True)
sys.exit(1)

"""Runs a command on a pseudo-terminal as a user at a terminal would: each PATTERN seen in the
output is answered with its TEXT (backslash escapes allowed), in order. Prints what the terminal
showed as JSON: {"chunks": [[seconds since start, text], ...], "status": exit code, "end": s}.

    pty_drive.py [PATTERN TEXT]... -- COMMAND [ARGS]...

PTY_SIZE=COLSxROWS in the environment sets the terminal's size (else the pty's own, 0 x 0).
A TEXT of "@resize COLSxROWS" resizes the terminal instead of typing (its foreground process
group gets SIGWINCH, as from a terminal window made larger).
"""
import fcntl
import json
import os
import pty
import select
import struct
import sys
import termios
import time

args = sys.argv[1:]
sep = args.index("--")
pairs, cmd = args[:sep], args[sep + 1 :]
answers = [(p.encode(), t.encode().decode("unicode_escape").encode()) for p, t in zip(pairs[0::2], pairs[1::2])]
pid, fd = pty.fork()
if pid == 0:
    size = os.environ.get("PTY_SIZE")
    if size:
        cols, rows = (int(v) for v in size.split("x"))
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    os.execvp(cmd[0], cmd)
t0 = time.time()
seen = b""
chunks = []
# A hang guard: a command still running after two minutes is killed (its status then says so).
while time.time() - t0 < 120:
    r, _, _ = select.select([fd], [], [], 0.1)
    if not r:
        continue
    try:
        data = os.read(fd, 4096)
    except OSError:  # EIO: every process on the terminal is gone
        break
    if not data:
        break
    chunks.append([time.time() - t0, data.decode(errors="replace")])
    seen += data
    while answers and answers[0][0] in seen:
        seen = seen.split(answers[0][0], 1)[1]
        text = answers[0][1]
        if text.startswith(b"@resize "):
            cols, rows = (int(v) for v in text[8:].decode().split("x"))
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        else:
            os.write(fd, text)
        answers.pop(0)
else:
    os.kill(pid, 9)
_, status = os.waitpid(pid, 0)
print(json.dumps({"chunks": chunks, "status": os.waitstatus_to_exitcode(status), "end": time.time() - t0}))

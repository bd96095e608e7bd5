"""`python -m nrun ARGS` runs the wheel's binary with ARGS (exec: nrun owns the process)."""

import os
import sys

from nrun import find_nrun_bin


def _run() -> None:
    nrun = find_nrun_bin()
    # exec, not a child: signals, the terminal's foreground and the exit code are nrun's own.
    os.execv(nrun, [nrun, *sys.argv[1:]])


if __name__ == "__main__":
    _run()

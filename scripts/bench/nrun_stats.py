"""What a benchmark reads from one run of nrun under GNU time (`/usr/bin/time -f "%e %M"`,
NRUN_LOG=debug): shared by scale.py and tree.py."""
import re
import subprocess
import threading
import time


def cpu_and_rss(err):
    """nrun's own CPU seconds (its debug getrusage line) and the peak RSS in KiB (GNU time's
    last line); None where the run did not say."""
    cpu = None
    m = re.search(r"nrun's own CPU: ([\d.]+) s user \+ ([\d.]+) s system", err)
    if m:
        cpu = float(m.group(1)) + float(m.group(2))
    rss_kb = None
    last = err.strip().splitlines()[-1] if err.strip() else ""
    m = re.match(r"^([\d.]+) (\d+)$", last)
    if m:
        rss_kb = int(m.group(2))
    return cpu, rss_kb


def run(cmd, env, look):
    """Runs `cmd` (stdout dropped, stderr kept), calling `look(pid)` with its pid every 20 ms
    until it ends (an OSError there is a process ending under it, and ignored). Returns the
    exit code, stderr as text and the wall time in seconds."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                look(p.pid)
            except OSError:
                pass
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _, err = p.communicate()
    wall = time.perf_counter() - start
    done.set()
    t.join()
    return p.returncode, err.decode(errors="replace"), wall

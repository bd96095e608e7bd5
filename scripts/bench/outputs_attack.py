#!/usr/bin/env python3
"""Issue 46's cases against nrun's outputs and inputs, for each binary given (NAME=PATH ...):

- `nrun report` on the audit's crafted reports (N hosts named only by marks, N attempts that
  name no node): time, peak memory (the child's own, wait4), page size; under a 1.5 GiB
  address-space limit, so a quadratic page fails here instead of taking the machine.
- `nrun report /dev/zero` (same limit) and a FIFO nobody writes (a 10 s bound).
- `--metrics-port`: 1,000 connections that send half a request head and wait, then 5 scrapes,
  each given 10 s.
- A FIFO at `--report` whose reader reads nothing: SIGTERM once the pipe is full, time to exit
  (a 10 s bound).

Run as: python3 scripts/bench/outputs_attack.py old=/path/nrun new=target/release/nrun
"""
import fcntl, json, os, resource, signal, socket, subprocess, sys, tempfile, termios, struct, time

LIMIT = 1536 << 20


def limited():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def run(argv, timeout=60, limit=True):
    t = time.time()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=limited if limit else None)
    deadline = t + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            took = time.time() - t
            err = p.stderr.read().decode(errors="replace").strip().splitlines()
            code = os.waitstatus_to_exitcode(status)
            return code, took, ru.ru_maxrss, (err[-1] if err else "")
        if time.time() > deadline:
            p.kill(); p.wait()
            return None, timeout, 0, "hung: killed after %d s" % timeout
        time.sleep(0.01)


def craft(d, n):
    ev = [{"name": "worker_failed", "t": i * 0.01, "host": "h%d" % i, "node": i} for i in range(n)]
    ev += [{"name": "attempt_start", "t": i * 0.01, "attempt": i} for i in range(n)]
    path = os.path.join(d, "crafted-%d.json" % n)
    with open(path, "w") as f:
        json.dump({"job": {"outcome": "failed"}, "events": ev}, f)
    return path


def report_cases(name, nrun, d):
    for n in (500, 1000, 3600):
        path = craft(d, n)
        out = path + "." + name + ".html"
        code, took, rss, last = run([nrun, "report", path, "-o", out])
        size = os.path.getsize(out) if code == 0 else 0
        print("%s report crafted n=%d (%d KiB): exit %s, %.2f s, peak %d MiB, page %d KiB %s" % (
            name, n, os.path.getsize(path) >> 10, code, took, rss >> 10, size >> 10,
            "" if code == 0 else "(" + last[:100] + ")"))
    code, took, rss, last = run([nrun, "report", "/dev/zero", "-o", os.path.join(d, "z.html")])
    print("%s report /dev/zero: exit %s, %.2f s, peak %d MiB (%s)" % (name, code, took, rss >> 10, last[:100]))
    fifo = os.path.join(d, "in.fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    code, took, rss, last = run([nrun, "report", fifo, "-o", os.path.join(d, "f.html")], timeout=10)
    print("%s report FIFO: exit %s, %.2f s (%s)" % (name, code, took, last[:100]))


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def metrics_case(name, nrun):
    port = free_port()
    p = subprocess.Popen([nrun, "--metrics-port", str(port), "--no-python", "sleep", "120"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close(); break
        except OSError:
            time.sleep(0.05)
    slow = []
    for _ in range(1000):
        c = socket.socket(); c.setblocking(False)
        c.connect_ex(("127.0.0.1", port)); slow.append(c)
    time.sleep(0.5)
    for c in slow:
        try:
            c.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            pass
    took = []
    for _ in range(5):
        t = time.time()
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            c.settimeout(10)
            c.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            ok = c.recv(12).startswith(b"HTTP/1.1 200")
            took.append("%.1f ms" % ((time.time() - t) * 1000) if ok else "refused")
        except OSError as e:
            took.append("no answer in 10 s" if isinstance(e, socket.timeout) else str(e))
    print("%s metrics scrapes beside 1,000 slow connections: %s" % (name, ", ".join(took)))
    for c in slow:
        c.close()
    p.terminate(); p.wait()


def fifo_sigterm_case(name, nrun, d):
    fifo = os.path.join(d, "report-%s.fifo" % name)
    os.mkfifo(fifo)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    size = fcntl.fcntl(r, 1031, 4096)  # F_SETPIPE_SZ
    p = subprocess.Popen([nrun, "--report", fifo, "--nproc", "4", "--no-python", "true"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    queued = lambda: struct.unpack("i", fcntl.ioctl(r, termios.FIONREAD, b"\0\0\0\0"))[0]
    t0 = time.time()
    while queued() < size and p.poll() is None and time.time() - t0 < 60:
        time.sleep(0.01)
    t = time.time()
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=10)
        print("%s SIGTERM while writing a full FIFO: exit %s %.3f s after the signal" % (name, p.returncode, time.time() - t))
    except subprocess.TimeoutExpired:
        p.kill(); p.wait()
        print("%s SIGTERM while writing a full FIFO: still running 10 s after the signal (killed)" % name)
    os.close(r)


def main():
    bins = [a.split("=", 1) for a in sys.argv[1:]]
    with tempfile.TemporaryDirectory() as d:
        for name, nrun in bins:
            report_cases(name, nrun, d)
        for name, nrun in bins:
            metrics_case(name, nrun)
        for name, nrun in bins:
            fifo_sigterm_case(name, nrun, d)


main()

"""Asks NCCL's RAS (on this host, port 28028 unless NCCL_RAS_ADDR says otherwise) for its
status, as the `ncclras` client does: a text protocol. Prints what it answered."""
import os, socket, sys, time
addr = os.environ.get("NCCL_RAS_ADDR", "localhost:28028")
host, port = addr.rsplit(":", 1)
verbose = "VERBOSE " if "-v" in sys.argv else ""
t0 = time.time()
s = socket.create_connection((host, int(port)), timeout=3)
def line():
    b = b""
    while not b.endswith(b"\n"):
        c = s.recv(1)
        if not c:
            break
        b += c
    return b.decode()
s.sendall(b"CLIENT PROTOCOL 2\n"); print("handshake:", line().strip())
s.sendall(b"TIMEOUT 5\n"); print("timeout:", line().strip())
s.settimeout(15)
s.sendall(f"{verbose}STATUS\n".encode())
out = b""
while True:
    c = s.recv(65536)
    if not c:
        break
    out += c
print(f"--- {len(out)} bytes in {time.time()-t0:.2f} s")
print(out.decode(errors="replace"))

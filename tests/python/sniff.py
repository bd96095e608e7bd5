"""Captures every frame on one interface for a while, as a passive sniffer on the wire would.

    sniff.py IFACE SECONDS OUT      writes the raw frames, concatenated, to OUT
Run inside the host's network namespace (ip netns exec HOST python3 sniff.py eth0 10 out.bin).
"""
import socket
import sys
import time

iface, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))  # ETH_P_ALL
s.bind((iface, 0))
s.settimeout(0.2)
end = time.time() + seconds
with open(out, "wb") as f:
    f.write(b"")
    print("sniffing", flush=True)
    while time.time() < end:
        try:
            f.write(s.recv(65535))
        except socket.timeout:
            pass

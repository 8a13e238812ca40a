"""A tree that talks to itself, for the soak (issue 47): a parent, a child it holds a TCP connection to
(as torchrun's ranks and store do) and a child it sends datagrams to (a metrics sidecar). Each step the
parent sends its number over both and folds both answers (the TCP child's running sum of squares, the
UDP child's of cubes) into a digest that depends only on the arguments: a restored run prints the one
an uninterrupted run prints only if both connections came back whole, nothing lost or repeated.

    python talk_tree.py --seed 7 --steps 150 --step-seconds 0.08
"""

import argparse
import hashlib
import os
import socket
import sys
import time

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--seed", type=int, default=7)
ap.add_argument("--steps", type=int, default=150)
ap.add_argument("--step-seconds", type=float, default=0.08)
args = ap.parse_args()
print(f"start-up: a parent, a TCP child and a UDP child (pid {os.getpid()})", flush=True)

listener = socket.create_server(("127.0.0.1", 0))
if os.fork() == 0:  # the TCP child
    stream = socket.create_connection(listener.getsockname()).makefile("rwb")
    total = 0
    while (line := stream.readline()) and line != b"end\n":
        total += int(line) ** 2
        stream.write(f"{total}\n".encode())
        stream.flush()
    os._exit(0)
conn, _ = listener.accept()
listener.close()
tcp = conn.makefile("rwb")

sidecar = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sidecar.bind(("127.0.0.1", 0))
if os.fork() == 0:  # the UDP child
    total = 0
    while (got := sidecar.recvfrom(64)) and got[0] != b"end":
        total += int(got[0]) ** 3
        sidecar.sendto(str(total).encode(), got[1])
    os._exit(0)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.connect(sidecar.getsockname())
sidecar.close()
udp.settimeout(10)

h = hashlib.sha256(str(args.seed).encode())
for step in range(1, args.steps + 1):
    n = args.seed * 1000 + step
    tcp.write(f"{n}\n".encode())
    tcp.flush()
    try:
        udp.send(str(n).encode())
        h.update(udp.recv(64))
    except OSError as e:  # a datagram lost across the restore: the sums would be wrong, so say so and stop
        print(f"step {step}: the UDP child did not answer ({type(e).__name__})", file=sys.stderr, flush=True)
        sys.exit(1)
    h.update(tcp.readline())
    print(f"step {step}/{args.steps}", flush=True)
    time.sleep(args.step_seconds)
tcp.write(b"end\n")
tcp.flush()
udp.send(b"end")
os.wait()
os.wait()
print(f"done digest={h.hexdigest()[:16]}", flush=True)

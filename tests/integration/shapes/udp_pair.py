"""Two processes of one tree talking over UDP, as a worker and its metrics sidecar do: the child serves on
every address (``0.0.0.0``), the parent sends to it at ``--host`` (the node's own address, as a sidecar
reached through the hostname is) over a connected socket, and each step is a datagram and its answer."""

import hashlib
import os
import socket
import sys

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--host", default="127.0.0.1", help="the address the parent sends to (the node's own, or loopback)")
args = ap.parse_args()
_shape.start(f"a parent and a child over UDP to {args.host}")
srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
srv.bind(("0.0.0.0", 0))
port = srv.getsockname()[1]
if os.fork() == 0:  # the child: answers each number with its square, keeping a running sum
    total = 0
    while True:
        data, peer = srv.recvfrom(64)
        if data == b"end":
            os._exit(0)
        total += int(data) ** 2
        srv.sendto(str(total).encode(), peer)
srv.close()
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c.connect((args.host, port))
c.settimeout(2)
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    try:
        c.send(str(s).encode())
        answer = c.recv(64)
    except OSError as e:  # no resend: the child's sum would count a step twice
        print(f"step {s}: {type(e).__name__}", file=sys.stderr, flush=True)
        sys.exit(1)
    h.update(answer)
    _shape.step(s, args.steps, args.step_seconds)
c.send(b"end")
os.wait()
_shape.done(h.hexdigest()[:16])

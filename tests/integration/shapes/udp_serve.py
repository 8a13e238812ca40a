"""A process holding a bound UDP socket (a health or metrics endpoint of a serving worker): between
steps it answers each datagram it got with the step it is at."""

import hashlib
import socket

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--host", default="127.0.0.1")
args = ap.parse_args()
_shape.start(f"answering on {args.host}:{args.port} over UDP")
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind((args.host, args.port))
sock.setblocking(False)
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    h.update(str(s).encode())
    while True:
        try:
            _, peer = sock.recvfrom(64)
        except BlockingIOError:
            break
        sock.sendto(f"at step {s}".encode(), peer)
    _shape.step(s, args.steps, args.step_seconds)
_shape.done(h.hexdigest()[:16])

"""A client with a connected UDP socket to a service outside its tree (a DNS resolver, a metrics
collector that answers): each step sends its number and folds the answer into its state. As UDP
clients do, a datagram that gets no answer within a second (lost, or the socket failed) is sent again."""

import hashlib
import socket
import sys

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--host", default="127.0.0.1")
args = ap.parse_args()
_shape.start(f"sending to {args.host}:{args.port} over UDP")
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.connect((args.host, args.port))
sock.settimeout(1)
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    while True:
        try:
            sock.send(f"{s}".encode())
            answer = sock.recv(64)
        except OSError as e:  # socket.timeout is one
            print(f"no answer ({type(e).__name__}) at step {s}; sending again", file=sys.stderr, flush=True)
            continue
        if answer == f"{s}".encode():
            break  # an answer to an earlier step's resend is dropped
    h.update(answer)
    _shape.step(s, args.steps, args.step_seconds)
_shape.done(h.hexdigest()[:16])

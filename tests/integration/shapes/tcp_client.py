"""A client holding an established TCP connection to a service outside its tree (an echo server): each
step sends a line and folds the echo into its state. As client libraries do, a connection found closed
(EOF, a reset, a broken pipe) is opened again and the step's line sent again."""

import hashlib
import socket
import sys

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--host", default="127.0.0.1")
args = ap.parse_args()
_shape.start(f"connecting to {args.host}:{args.port}")


def connect():
    return socket.create_connection((args.host, args.port)).makefile("rwb")


stream = connect()
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    while True:
        try:
            stream.write(f"{s}\n".encode())
            stream.flush()
            echo = stream.readline()
        except OSError as e:
            echo, why = b"", type(e).__name__
        else:
            why = "EOF"
        if echo:
            break
        print(f"connection closed ({why}) at step {s}; reconnecting", file=sys.stderr, flush=True)
        stream = connect()
    h.update(echo)
    _shape.step(s, args.steps, args.step_seconds)
_shape.done(h.hexdigest()[:16])

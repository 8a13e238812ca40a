"""A process holding an established TCP connection to a local service (an echo server): each step
sends a line and folds the echo into its state."""

import hashlib
import socket

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--port", type=int, required=True)
args = ap.parse_args()
_shape.start(f"connecting to 127.0.0.1:{args.port}")
conn = socket.create_connection(("127.0.0.1", args.port))
stream = conn.makefile("rwb")
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    stream.write(f"{s}\n".encode())
    stream.flush()
    h.update(stream.readline())
    _shape.step(s, args.steps, args.step_seconds)
_shape.done(h.hexdigest()[:16])

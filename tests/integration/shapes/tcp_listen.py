"""A process holding a listening TCP socket on 127.0.0.1: between steps it answers whoever
connected with the step it is at."""

import hashlib
import socket

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--port", type=int, required=True)
args = ap.parse_args()
_shape.start(f"listening on 127.0.0.1:{args.port}")
srv = socket.socket()
srv.bind(("127.0.0.1", args.port))
srv.listen()
srv.settimeout(0)
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    h.update(str(s).encode())
    try:
        conn, _ = srv.accept()
    except BlockingIOError:
        pass
    else:
        with conn:
            conn.setblocking(True)
            conn.sendall(f"at step {s}\n".encode())
    _shape.step(s, args.steps, args.step_seconds)
_shape.done(h.hexdigest()[:16])

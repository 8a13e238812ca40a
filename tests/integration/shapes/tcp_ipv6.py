"""A process holding two IPv6 listeners, as servers bind ``[::]``: one IPv6-only (``IPV6_V6ONLY``), one
dual-stack that IPv4 clients reach too. Between steps it answers whoever connected to either with the
step it is at and which one it was."""

import hashlib
import socket

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--port-v6only", type=int, required=True)
ap.add_argument("--port-dual", type=int, required=True)
args = ap.parse_args()
_shape.start(f"listening on [::]:{args.port_v6only} (IPv6 only) and [::]:{args.port_dual} (dual stack)")
listeners = {}
for name, port, v6only in (("v6only", args.port_v6only, 1), ("dual", args.port_dual, 0)):
    srv = socket.socket(socket.AF_INET6)
    srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    srv.bind(("::", port))
    srv.listen()
    srv.settimeout(0)
    listeners[name] = srv
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    h.update(str(s).encode())
    for name, srv in listeners.items():
        try:
            conn, _ = srv.accept()
        except BlockingIOError:
            continue
        with conn:
            conn.setblocking(True)
            conn.sendall(f"at step {s} {name}\n".encode())
    _shape.step(s, args.steps, args.step_seconds)
_shape.done(h.hexdigest()[:16])

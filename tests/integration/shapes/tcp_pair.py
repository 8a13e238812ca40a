"""Two processes of one tree talking over a loopback TCP connection, as a torchrun job's ranks and its
store do: the parent listens, a forked child connects, and each step is a request and an answer that
both fold into their state."""

import hashlib
import os
import socket

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--host", default="127.0.0.1", help="the address they talk over (the node's own, or loopback)")
args = ap.parse_args()
_shape.start(f"a parent and a child over TCP on {args.host}")
srv = socket.create_server((args.host, 0))
port = srv.getsockname()[1]
if os.fork() == 0:  # the child: answers each number with its square, keeping a running sum
    c = socket.create_connection((args.host, port)).makefile("rwb")
    total = 0
    while line := c.readline():
        total += int(line) ** 2
        c.write(f"{total}\n".encode())
        c.flush()
    os._exit(0)
conn, _ = srv.accept()
stream = conn.makefile("rwb")
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    stream.write(f"{s}\n".encode())
    stream.flush()
    answer = stream.readline()
    assert answer, f"the child's connection ended at step {s}"
    h.update(answer)
    _shape.step(s, args.steps, args.step_seconds)
stream.close()
conn.close()
os.wait()
_shape.done(h.hexdigest()[:16])

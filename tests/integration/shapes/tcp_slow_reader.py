"""A client reading, a little at each step, a document a service outside its tree sent whole and then
closed its end of (HTTP/1.0, ``Connection: close``: the end of the stream is the end of the document,
so the socket sits in CLOSE_WAIT with the rest unread). A read that fails means a broken connection:
as clients do, it fetches the document again and skips what it already has."""

import hashlib
import socket
import sys

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--chunk", type=int, default=256)
args = ap.parse_args()
_shape.start(f"fetching a document from 127.0.0.1:{args.port}")


def fetch(skip: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", args.port))
    conn.sendall(b"GET\n")
    while skip:
        skip -= len(conn.recv(min(skip, 65536)))
    return conn


conn = fetch(0)
got = bytearray()
ended = False


def read(n: int) -> bytes:
    """Up to ``n`` bytes of the document; b"" at its end (the service's EOF)."""
    global conn
    while True:
        try:
            return conn.recv(n)
        except OSError as e:
            print(f"connection closed ({type(e).__name__}) at byte {len(got)}; fetching again", file=sys.stderr,
                  flush=True)
            conn = fetch(len(got))


for s in range(1, args.steps + 1):
    if not ended:
        data = read(args.chunk)
        got += data
        ended = not data
    _shape.step(s, args.steps, args.step_seconds)
while data := read(65536):
    got += data
_shape.done(f"{hashlib.sha256(bytes(got)).hexdigest()[:16]} bytes={len(got)}")

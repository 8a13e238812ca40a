"""Two parts of one job on two nodes, talking over one TCP connection with no checkpoint code: part 0
serves (``--serve ADDR:PORT``), part 1 connects (``--connect ADDR:PORT``). At each step part 1 sends a
number drawn from what it last heard, part 0 folds it into its state and answers with the state. Each
part prints ``step i/N`` and, at the end, ``done digest=<its state>``: a message lost, repeated or
reordered across a checkpoint changes both digests, and an uninterrupted run's are the reference."""

import argparse
import hashlib
import socket
import time

ap = argparse.ArgumentParser()
ap.add_argument("--serve")
ap.add_argument("--connect")
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--step-seconds", type=float, default=0.1)
a = ap.parse_args()


def exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise SystemExit(f"the other part closed the connection after {len(data)} of {n} bytes")
        data += more
    return data


state = hashlib.sha256(b"start").digest()
if a.serve:
    host, port = a.serve.rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    conn, _ = server.accept()
    server.close()
    for step in range(1, a.steps + 1):
        state = hashlib.sha256(state + exactly(conn, 32)).digest()
        conn.sendall(state)
        print(f"step {step}/{a.steps}", flush=True)
else:
    host, port = a.connect.rsplit(":", 1)
    for _ in range(600):
        try:
            conn = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            time.sleep(0.1)
    conn.settimeout(None)
    for step in range(1, a.steps + 1):
        conn.sendall(hashlib.sha256(state + step.to_bytes(4, "big")).digest())
        state = exactly(conn, 32)
        print(f"step {step}/{a.steps}", flush=True)
        time.sleep(a.step_seconds)
print(f"done digest={state.hex()[:16]}", flush=True)

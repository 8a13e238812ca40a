"""A Python process that shells out with ``preexec_fn`` at every step, for the soak (shape "preexec").

What it imitates: the many Python programs (build tools, schedulers' task runners, old daemons, code
written for Python 2) that run their helper commands with ``subprocess.run(..., preexec_fn=...)``, here
the classic ``preexec_fn`` that puts SIGPIPE back to its default for the child. A ``preexec_fn`` makes
CPython fork (a real fork of the whole interpreter, its heap copy-on-write), where it would otherwise use
vfork or posix_spawn: so a process with a big and growing heap forks a few times per step, and a
checkpoint can find a child between fork and exec, sharing every page of the parent, or a parent that
waits on one. After a lazy restore, pages streaming into the parent must not be lost to the children's
forks, and the forks must go on.

The state is a seeded bytearray that grows at every step (and is rewritten in places) and a dict of
every child's answer. Each step feeds slices of the state to ``sha256sum``, ``sort``, ``tr`` and
``wc -c`` and folds what they print into a running digest; at the end the digest takes the whole
bytearray and the dict. It depends only on the arguments.

    python preexec_spawn.py --seed 1 --steps 120 --step-seconds 0.05 [--mb 48]
"""

import argparse
import hashlib
import os
import random
import signal
import subprocess
import time

ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--step-seconds", type=float, default=0.05)
ap.add_argument("--mb", type=int, default=48, help="the state's size at start (it grows 64 KiB per step)")
args = ap.parse_args()


def default_sigpipe() -> None:  # what preexec_fn is most often used for
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def run(argv: list[str], data: bytes) -> bytes:
    r = subprocess.run(argv, input=data, stdout=subprocess.PIPE, preexec_fn=default_sigpipe, check=True,
                       env={"LC_ALL": "C", "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    return r.stdout


print(f"start-up: {args.mb} MiB of state, forking children with preexec_fn (pid {os.getpid()})", flush=True)
rng = random.Random(args.seed)
state = bytearray(rng.randbytes(args.mb << 20))
answers: dict[str, str] = {}
total = hashlib.sha256(f"preexec:{args.seed}".encode())
for step in range(1, args.steps + 1):
    state += rng.randbytes(64 << 10)
    for _ in range(16):  # a few rewrites anywhere, so each checkpoint has changed pages all over
        at = rng.randrange(len(state) - 4096)
        state[at:at + 4096] = bytes(b ^ (step & 0xFF) for b in state[at:at + 4096])
    lo = rng.randrange(len(state) - (256 << 10))
    piece = bytes(state[lo:lo + (256 << 10)])
    words = b"\n".join(piece[i:i + 12].hex().encode() for i in range(0, 4096, 12))
    outs = [
        run(["sha256sum"], piece),
        run(["sort"], words),
        run(["tr", "0-9a-f", "g-v"], words[:2048]),
        run(["wc", "-c"], piece[: rng.randrange(1, len(piece))]),
    ]
    for k, o in enumerate(outs):
        answers[f"{step}.{k}"] = hashlib.sha256(o).hexdigest()[:16]
        total.update(o)
    total.update(state[rng.randrange(len(state) - (1 << 20)):][: 1 << 20])  # a page-by-page read of 1 MiB
    print(f"step {step}/{args.steps}", flush=True)
    time.sleep(args.step_seconds)
total.update(state)
total.update(repr(sorted(answers.items())).encode())
print(f"done digest={total.hexdigest()[:16]}", flush=True)

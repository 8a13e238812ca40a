"""A training-style workload for tests and the demo: numpy state, steps, printed progress.

Deterministic: the final digest depends only on the arguments, so a run that was checkpointed,
killed and restored must print the same digest as an uninterrupted one.

    python train.py --mb 200 --steps 40 --step-seconds 0.1 [--log FILE] [--threads 2] [--child]
                    [--fast-after-restores N]
"""

import argparse
import hashlib
import os
import subprocess
import sys
import threading
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--mb", type=int, default=100)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--step-seconds", type=float, default=0.1)
ap.add_argument("--log", help="append one line per step to this file (held open for appending)")
ap.add_argument("--threads", type=int, default=0, help="extra threads that each keep a counter")
ap.add_argument("--child", action="store_true", help="keep a child process that echoes through a pipe")
ap.add_argument("--change-fraction", type=float, default=0.01, help="fraction of state rewritten per step")
ap.add_argument("--fast-after-restores", type=int, default=0, metavar="N",
                help="from its Nth restore on, steps no longer sleep: for a test that then waits only for the "
                     "digest (the same either way); 0 = never")
args = ap.parse_args()


def started() -> str:
    """This process's start time (/proc/self/stat, field 22): a restored process is a new task to the
    kernel, and CRIU cannot set it, so it changes at each restore and only then (a heartbeat's freeze
    and dump keep the task)."""
    with open("/proc/self/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


born, restores = started(), 0

print(f"start-up: allocating {args.mb} MB (pid {os.getpid()})", flush=True)
rng = np.random.default_rng(1234)
state = rng.standard_normal(args.mb * (1 << 20) // 8)
log = open(args.log, "a") if args.log else None

counters = [0] * args.threads
def tick(i):
    while True:
        counters[i] += 1
        time.sleep(0.01)
for i in range(args.threads):
    threading.Thread(target=tick, args=(i,), daemon=True).start()

child = None
if args.child:
    child = subprocess.Popen([sys.executable, "-u", "-c",
        "import sys\nfor line in sys.stdin:\n    print(line.strip()[::-1], flush=True)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

n = len(state)
span = max(1, int(n * args.change_fraction))
for step in range(args.steps):
    lo = (step * span) % max(1, n - span)
    state[lo:lo + span] = state[lo:lo + span] * 0.5 + step
    if child:
        child.stdin.write(f"step{step}\n"); child.stdin.flush()
        echoed = child.stdout.readline().strip()
        assert echoed == f"step{step}"[::-1], echoed
    if log:
        log.write(f"step {step}\n"); log.flush()
    if args.threads:  # every thread is still running (also after a restore): each counter moves
        # A generous deadline, not a fixed 30 ms: on a loaded machine (or while a lazy restore still
        # serves pages) a live thread can miss a short window; a dead one never moves at all.
        seen = list(counters)
        deadline = time.monotonic() + 10
        while not all(c > s for c, s in zip(counters, seen)) and time.monotonic() < deadline:
            time.sleep(0.01)
        moved = list(counters)
        assert all(c > s for c, s in zip(moved, seen)), (moved, seen)
    print(f"step {step + 1}/{args.steps}", flush=True)
    if args.fast_after_restores and (now := started()) != born:
        born, restores = now, restores + 1
    if not (args.fast_after_restores and restores >= args.fast_after_restores):
        time.sleep(args.step_seconds)

digest = hashlib.sha256(state.tobytes()).hexdigest()[:16]
print(f"done digest={digest}", flush=True)
if child:
    child.stdin.close(); child.wait()

"""A workload that writes files it holds open, for the soak: an append-only log and a state file
rewritten in place (seek, write, no close). A restore must bring both back as they were at the
checkpoint, so that the log holds every step exactly once, in order, and the digest equals an
uninterrupted run's.

    python open_files.py --dir OUT --seed 5 --steps 80 --step-seconds 0.05
"""

import argparse
import hashlib
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
ap.add_argument("--seed", type=int, default=5)
ap.add_argument("--steps", type=int, default=80)
ap.add_argument("--step-seconds", type=float, default=0.05)
args = ap.parse_args()

print(f"start-up: opening files in {args.dir} (pid {os.getpid()})", flush=True)
os.makedirs(args.dir, exist_ok=True)
log = open(os.path.join(args.dir, "steps.log"), "a")
state = open(os.path.join(args.dir, "state.bin"), "w+b")
h = hashlib.sha256(str(args.seed).encode())
for step in range(args.steps):
    h.update(step.to_bytes(4, "little"))
    log.write(f"step {step} {h.hexdigest()[:12]}\n")
    log.flush()
    state.seek(0)
    state.write(h.digest() * 64)  # the same size each step: rewritten in place
    state.flush()
    print(f"step {step + 1}/{args.steps}", flush=True)
    time.sleep(args.step_seconds)
log.close()
state.seek(0)
digest = hashlib.sha256(state.read() + open(os.path.join(args.dir, "steps.log"), "rb").read()).hexdigest()[:16]
print(f"done digest={digest}", flush=True)

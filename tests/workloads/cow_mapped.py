"""A workload whose big memory is a private mapping of a file it wrote into (``np.memmap(mode="c")``,
as ``np.load(mmap_mode="c")`` gives): copy-on-write pages of a file, which CRIU never marks lazy,
so a lazy restore writes all of them before ``criu restore`` (one long run of a pages image).

    python cow_mapped.py --mb 96 --steps 100 --step-seconds 0.05
"""

import argparse
import hashlib
import os
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--mb", type=int, default=96)
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--step-seconds", type=float, default=0.05)
args = ap.parse_args()

print(f"start-up: mapping {args.mb} MB (pid {os.getpid()})", flush=True)
n = args.mb << 20
with open("mapped.bin", "wb") as f:
    f.truncate(n)
a = np.memmap("mapped.bin", dtype=np.uint8, mode="c", shape=(n,))  # MAP_PRIVATE: what we write stays ours
a[:] = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
for step in range(args.steps):
    a[step * 4096:(step + 1) * 4096] += 1
    print(f"step {step + 1}/{args.steps}", flush=True)
    time.sleep(args.step_seconds)
print(f"done digest={hashlib.sha256(a).hexdigest()[:16]}", flush=True)

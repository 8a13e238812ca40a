"""The cooperative benchmark's workload (bench/cooperative.py): holds ``--mb`` MB of random state in 8
parts and writes them as files when its supervisor asks (cedana_airflow.coop); after each answer it
rewrites ``--change`` of the state, so every next checkpoint differs from the last by that much: in each
part one contiguous span (``--run-kib 0``, as tests/workloads/train.py changes its memory), or runs of
``--run-kib`` KiB at random places."""

import argparse
import time

import numpy as np

from cedana_airflow import coop

ap = argparse.ArgumentParser()
ap.add_argument("--mb", type=int, default=1024)
ap.add_argument("--change", type=float, default=0.02)
ap.add_argument("--run-kib", type=int, default=0)
a = ap.parse_args()

PARTS = 8
span = 0
rng = np.random.default_rng(0)
parts = [rng.integers(0, 256, size=(a.mb << 20) // PARTS, dtype=np.uint8) for _ in range(PARTS)]
coop.listen()
print("ready", flush=True)
while True:
    n = coop.request()
    if not n:
        time.sleep(0.005)
        continue
    with coop.checkpoint() as d:
        for i, p in enumerate(parts):
            p.tofile(d / f"part-{i}.bin")
    for p in parts:  # the next checkpoint differs from this one by --change of the bytes
        if not a.run_kib:
            size = int(a.change * p.size)
            at = (span * size) % (p.size - size)
            p[at:at + size] = rng.integers(0, 256, size=size, dtype=np.uint8)
            continue
        run = a.run_kib << 10
        for _ in range(max(1, int(a.change * p.size / run))):
            at = int(rng.integers(0, p.size // run)) * run
            p[at:at + run] = rng.integers(0, 256, size=run, dtype=np.uint8)
    span += 1
    print(f"answered {n}", flush=True)

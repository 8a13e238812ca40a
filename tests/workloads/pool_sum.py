"""A multiprocessing.Pool job for the soak: a parent and its pool of workers, results over pipes
and through shared memory.

The parent maps seeded random bytes into shared anonymous memory (``mmap(-1)``) before the pool
forks; each piece of work reads its slice of it and writes its result back into it, and the parent
folds both the returned and the shared results into a running digest. The digest depends only on
the arguments: a restored run must print the same one as an uninterrupted run, which it cannot if
the shared memory came back wrong (as zeros, say).

    python pool_sum.py --seed 3 --steps 60 --workers 2 --step-seconds 0.05
"""

import argparse
import hashlib
import mmap
import multiprocessing as mp
import os
import random
import time

PARTS, SLICE = 8, 256 << 10
shared = mmap.mmap(-1, PARTS * SLICE + PARTS * 32)  # MAP_SHARED | MAP_ANONYMOUS, inherited by the pool


def work(job: tuple[int, int, int]) -> str:
    seed, step, part = job
    h = hashlib.sha256(f"{seed}:{step}:{part}".encode() + shared[part * SLICE:(part + 1) * SLICE])
    for _ in range(2000):  # a little CPU in the worker, so that a checkpoint finds them busy
        h = hashlib.sha256(h.digest())
    shared[PARTS * SLICE + part * 32:PARTS * SLICE + (part + 1) * 32] = h.digest()
    return h.hexdigest()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--step-seconds", type=float, default=0.05)
    args = ap.parse_args()

    print(f"start-up: starting a pool of {args.workers} (pid {os.getpid()})", flush=True)
    shared[:PARTS * SLICE] = random.Random(args.seed).randbytes(PARTS * SLICE)
    total = hashlib.sha256(str(args.seed).encode())
    with mp.get_context("fork").Pool(args.workers) as pool:
        for step in range(args.steps):
            for r in pool.map(work, [(args.seed, step, p) for p in range(PARTS)]):
                total.update(r.encode())
            total.update(shared[PARTS * SLICE:])
            print(f"step {step + 1}/{args.steps}", flush=True)
            time.sleep(args.step_seconds)
    print(f"done digest={total.hexdigest()[:16]}", flush=True)

"""A cooperative workload: sums a seeded sequence step by step, its state written only when asked
(cedana_airflow.coop), resumed from CEDANA_RESTORE_DIR. Prints ``step N`` per step and ``done total=T``.

--no-listen: never declares it answers (mode auto must leave it unprotected, saying so).
--never-complete: writes its state but never creates COMPLETE (the heartbeat must time out).
--ranks N: N processes (fork) each write their part; --die-rank R: rank R exits mid-write at request 2.
--slow-first S: the first request's write takes S seconds (it outlives its deadline, or meets a stop).
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path

from cedana_airflow import coop

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--step-seconds", type=float, default=0.05)
ap.add_argument("--no-listen", action="store_true")
ap.add_argument("--never-complete", action="store_true")
ap.add_argument("--ranks", type=int, default=1)
ap.add_argument("--die-rank", type=int, default=-1)
ap.add_argument("--mb", type=int, default=0, help="a state file of this many MiB besides the counter")
ap.add_argument("--slow-first", type=float, default=0.0)
a = ap.parse_args()


def run(rank: int) -> None:
    step, total = 0, 0
    if (d := coop.restore_dir()) is not None:
        step, total = map(int, (d / f"rank-{rank}" / "counter").read_text().split())
        print(f"rank {rank} resumed at step {step}", flush=True)
    if not a.no_listen:
        coop.listen()
    rng = random.Random(1000 * rank + step)
    blob = bytes(rng.getrandbits(8) for _ in range(4096)) * (a.mb * 256)
    while step < a.steps:
        total += random.Random(step).randrange(1000)
        step += 1
        if rank == 0:
            print(f"step {step}", flush=True)
        time.sleep(a.step_seconds)
        n = coop.request()
        if n:
            if a.never_complete:
                (coop.checkpoint_dir() / "partial").write_text("x")
                coop._answered = n  # answered, but no COMPLETE: the supervisor must give up on it
                continue
            with coop.checkpoint(rank, a.ranks) as d:
                if n == 1 and a.slow_first:
                    time.sleep(a.slow_first)  # meanwhile the request is withdrawn: these writes go nowhere kept
                    (d / f"late-from-request-{n}").write_text("x")
                part = d / f"rank-{rank}"
                part.mkdir()
                if blob:
                    (part / "blob").write_bytes(blob)
                if rank == a.die_rank and n == 2:
                    os._exit(3)  # dies mid-write: its marker never comes
                (part / "counter").write_text(f"{step} {total}")
    if rank == 0:
        print(f"done total={total}", flush=True)


pids = []
for r in range(1, a.ranks):
    if (pid := os.fork()) == 0:
        run(r)
        os._exit(0)
    pids.append(pid)
run(0)
bad = [os.waitpid(p, 0)[1] for p in pids]
sys.exit(1 if any(bad) else 0)

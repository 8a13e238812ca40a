"""Jobs that span nodes (issue 53): a coordinated checkpoint of 2 and of 4 parts against one part alone,
in the same run.                       target: a part held <= 2x alone (2 parts), <= 4x alone (4 parts)

Each part is a real supervisor (``cedana-airflow run --job-part r/N``, CRIU, a ``file://`` store) of a
Python process holding ``--job-mb`` MiB of random bytes that it keeps touching; one part alone is the
same run without ``--job-part``. Each configuration runs until ``reps`` heartbeats are committed; the
figures come from the committed manifests: per round, the longest a part was held frozen (its dump and
its wait for the last part: the commit's ``freeze_seconds``) and the freeze skew (from the first part's
freeze to the last one's). On this machine every part shares its two cores, where a real job's parts
each have their own node: their dumps contend, so the held time here is an upper bound.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import med, say, spread, stored_manifests

TARGETS = {2: 2.0, 4: 4.0}
HEARTBEAT = "3"


def _workload(mb: int) -> list[str]:
    return [sys.executable, "-c", f"import os, time\nb = bytearray(os.urandom({mb} << 20))\n"
            "while True:\n    b[0] = (b[0] + 1) % 256\n    time.sleep(0.05)\n"]


def _configuration(parts: int, mb: int, reps: int, work: Path) -> dict[str, Any]:
    """``parts`` supervisors (1: a part alone, no --job-part) until ``reps`` heartbeats are committed."""
    cid = f"bench-job-{parts}"
    store = work / "store"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEDANA_")}
    procs = []
    for r in range(parts):
        cwd = work / f"{cid}-part-{r}"  # a node's own disk: CRIU's proc.crtools goes into the workload's cwd
        cwd.mkdir(parents=True)
        argv = [sys.executable, "-m", "cedana_airflow", "run", "--id", cid, "--heartbeat", HEARTBEAT,
                *(["--job-part", f"{r}/{parts}"] if parts > 1 else []), "--", *_workload(mb)]
        procs.append(subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=open(cwd / "err", "wb"),
                                      env={**env, "CEDANA_STORE": f"file://{store}", "CEDANA_WORK_DIR": str(cwd / "w"),
                                           "CEDANA_NODE": f"part-{r}", "CEDANA_KEEP_CHECKPOINTS": "100"}))
    try:
        deadline = time.monotonic() + 120 + 10 * reps
        while len(ms := stored_manifests(store, cid)) < reps + 1:  # the first one writes every chunk: left out
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                errs = [(work / f"{cid}-part-{r}" / "err").read_text()[-800:] for r in range(parts)]
                raise SystemExit(f"job bench: {parts} part(s) committed {len(ms)} of {reps + 1}: {errs}")
            time.sleep(0.5)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    ms = ms[1:reps + 1]
    held = [m["freeze_seconds"] for m in ms]
    skew = [m["job"]["freeze_skew_seconds"] for m in ms] if parts > 1 else [0.0] * len(ms)
    return {"parts": parts, "held_seconds": med(held), "held_spread": spread(held), "skew_seconds": med(skew),
            "skew_spread": spread(skew), "rounds": len(ms)}


def bench_jobs(mb: int, reps: int, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"mb": mb, "heartbeat_seconds": float(HEARTBEAT)}
    for parts in (1, 2, 4):
        say(f"job: {parts} part(s) of {mb} MiB, {reps} heartbeats")
        out[str(parts)] = _configuration(parts, mb, reps, work / f"parts-{parts}")
    alone = out["1"]["held_seconds"]
    out["ratios"] = {str(n): out[str(n)]["held_seconds"] / alone for n in TARGETS}
    out["targets"] = {str(n): t for n, t in TARGETS.items()}
    out["pass"] = {str(n): out["ratios"][str(n)] <= t for n, t in TARGETS.items()}
    return {"job": out}

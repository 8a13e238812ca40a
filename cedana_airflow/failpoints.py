"""Failpoints: named steps of a heartbeat and of a restore where the fault matrix (tests/faults/) makes
a real supervisor meet a fault at an exact moment. Off, and free, unless ``CEDANA_FAILPOINTS`` is set
(a test's environment; never a setting): ``step=action[@N]`` entries separated by ``;``, ``@N`` for
the Nth time the step is reached (default the first). Actions:

- ``kill-supervisor``: SIGKILL this process, as a node loss would; ``kill-supervisor+S`` does it S
  seconds later from a thread (so that it lands inside the step: a freeze, a dump);
- ``kill-workload``: SIGKILL the workload's tree root (where the step knows it);
- ``clock+S``: this process's wall clock jumps S seconds (negative: back) from now on;
- ``fill-disk``: fill the file system of the work directory until it is full (the step then meets
  ENOSPC, as a node whose disk filled up would);
- ``run:CMD``: run CMD (a shell command; ``{pid}`` is this process) and wait for it: a concurrent
  gc, a second writer.

The steps (docs/faults.md): heartbeat.freeze, heartbeat.frozen (inside CRIU's dump: the tree is frozen
and its images written, CRIU waits on its post-dump action), heartbeat.dump, heartbeat.capture, heartbeat.chunk,
heartbeat.upload, heartbeat.manifest, heartbeat.index, heartbeat.lease; restore.lease,
restore.manifest, restore.chunks, restore.criu, restore.resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "STEPS", "failpoint"]

ENV = "CEDANA_FAILPOINTS"
STEPS = ("heartbeat.freeze", "heartbeat.frozen", "heartbeat.dump", "heartbeat.capture", "heartbeat.chunk",
         "heartbeat.upload",
         "heartbeat.manifest", "heartbeat.index", "heartbeat.lease", "restore.lease", "restore.manifest",
         "restore.chunks", "restore.criu", "restore.resume")


@dataclass
class _Point:
    action: str
    nth: int
    hits: int = 0


_points: dict[str, _Point] | None = None
_lock = threading.Lock()


def _parse(spec: str) -> dict[str, _Point]:
    out: dict[str, _Point] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        step, _, action = entry.partition("=")
        nth = 1
        if "@" in action and not action.startswith("run:"):
            action, _, n = action.rpartition("@")
            nth = int(n)
        if step not in STEPS:
            raise ValueError(f"{ENV}: unknown step {step!r}; steps: {', '.join(STEPS)}")
        out[step] = _Point(action, nth)
    return out


def failpoint(step: str, *, workload: int | None = None, work_dir: Path | None = None) -> None:
    """Act on ``step`` if a test asked for it (see the module docstring); nothing otherwise."""
    global _points
    if _points is None:
        _points = _parse(os.environ.get(ENV, ""))
    point = _points.get(step)
    if point is None:
        return
    with _lock:
        point.hits += 1
        if point.hits != point.nth:
            return
    action = point.action
    if action.startswith("kill-supervisor"):
        delay = float(action.partition("+")[2] or 0)
        if delay:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    elif action == "kill-workload" and workload is not None:
        os.kill(workload, signal.SIGKILL)
    elif action.startswith("clock"):
        _jump(float(action[len("clock"):]))
    elif action == "fill-disk" and work_dir is not None:
        _fill(work_dir)
    elif action.startswith("run:"):
        env = {k: v for k, v in os.environ.items() if k != ENV}  # the command meets no failpoint of ours
        subprocess.run(action[4:].replace("{pid}", str(os.getpid())), shell=True, timeout=300, env=env)


def _jump(seconds: float) -> None:
    real = time.time
    time.time = lambda: real() + seconds  # a test-only clock, this process only


def _fill(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "failpoint-fill", "wb") as f:
        block = b"\0" * (1 << 20)
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass

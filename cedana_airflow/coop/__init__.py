"""The workload's side of a cooperative checkpoint: where to write, when asked, where to restore from.

For jobs transparent checkpointing cannot reach (several processes talking over NCCL, managed memory,
a host without CRIU), the workload writes its own state when its supervisor asks, and reads it back
when a retry starts. Standard library only: a workload imports this and nothing else of ours. Outside
a supervised run (no CEDANA_* variables) every call is a no-op: ``requested()`` is never true and
``restore_dir()`` is None, so the same script runs anywhere.

The contract (docs/cooperative.md), which any language can follow without this module:

* ``CEDANA_CHECKPOINT_REQUEST`` names a file that exists while a request is open; it holds JSON
  ``{"request": N, "dir": ..., "deadline": <unix time>}``. The signal named in
  ``CEDANA_CHECKPOINT_SIGNAL`` (SIGUSR1 by default) announces it to the processes that handle it.
* The workload writes its state into ``CEDANA_CHECKPOINT_DIR`` (a fresh, empty directory per request),
  then creates the empty file ``COMPLETE`` in it. Nothing written after COMPLETE is kept.
* Several processes: each writes its part, then ``.done-<rank>`` (holding N); the one of rank 0 waits
  for every rank's and creates COMPLETE. A rank that never finishes means no checkpoint, never half of one.
* On a retry the latest checkpoint's files are in ``CEDANA_RESTORE_DIR`` before the command starts.
* ``CEDANA_CHECKPOINT_READY``: a file the workload creates once it can answer (``listen()`` does);
  ``mode = auto`` on a node without CRIU asks only a workload that did.

    from cedana_airflow import coop

    state = coop.restore_dir()               # None on a fresh start
    step = int((state / "step").read_text()) if state else 0
    coop.listen()
    while step < steps:
        train_one_step(); step += 1
        if coop.requested():
            with coop.checkpoint() as d:     # COMPLETE is created when the block ends without error
                (d / "step").write_text(str(step))
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["COMPLETE", "ENV_DIR", "ENV_READY", "ENV_REQUEST", "ENV_RESTORE", "ENV_SIGNAL", "Abandoned", "checkpoint",
           "checkpoint_dir", "done", "listen", "request", "requested", "restore_dir"]

ENV_DIR = "CEDANA_CHECKPOINT_DIR"
ENV_REQUEST = "CEDANA_CHECKPOINT_REQUEST"
ENV_SIGNAL = "CEDANA_CHECKPOINT_SIGNAL"
ENV_READY = "CEDANA_CHECKPOINT_READY"
ENV_RESTORE = "CEDANA_RESTORE_DIR"
#: The marker that makes a written directory a checkpoint.
COMPLETE = "COMPLETE"
#: Per-rank markers: ``.done-<rank>``, holding the request number they answer.
DONE_PREFIX = ".done-"

_answered = 0  # the last request this process answered (or gave up on)
_signalled = threading.Event()


class Abandoned(Exception):
    """The supervisor withdrew the request (its deadline passed, the run is stopping) while this
    process was still writing: nothing of it is kept, and the workload should simply go on."""


def restore_dir() -> Path | None:
    """The restored state's directory on a resume; None on a fresh start or outside a supervised run."""
    d = os.environ.get(ENV_RESTORE)
    return Path(d) if d else None


def checkpoint_dir() -> Path | None:
    """Where a checkpoint is written (exists only while a request is open); None outside a supervised run."""
    d = os.environ.get(ENV_DIR)
    return Path(d) if d else None


def listen() -> None:
    """Declare that this workload answers requests: the signal now only sets a flag (its default action
    would end the process), and the ready file tells ``mode = auto`` it may ask. Call it once, early,
    from the main thread (Python's rule for signal handlers); elsewhere only the file is created."""
    name = os.environ.get(ENV_SIGNAL, "none")
    if name != "none" and threading.current_thread() is threading.main_thread():
        signal.signal(getattr(signal, name), lambda signum, frame: _signalled.set())
    if ready := os.environ.get(ENV_READY):
        with contextlib.suppress(OSError):
            Path(ready).touch()


def request() -> int:
    """The open request's number, 0 when none is open (or it was answered by this process)."""
    path = os.environ.get(ENV_REQUEST)
    if not path:
        return 0
    try:
        with open(path, "rb") as f:
            n = int(json.loads(f.read())["request"])
    except (OSError, ValueError, KeyError, TypeError):  # none open, or being replaced this instant
        return 0
    return n if n > _answered else 0


def requested() -> bool:
    """Whether the supervisor asks for a checkpoint now. Cheap (one small file read): call it at every
    step boundary. Each process of a multi-process job sees the request on its own; ranks that must
    checkpoint at the same step agree first (cedana_airflow.coop.torch.requested does, collectively)."""
    _signalled.clear()
    return request() > 0


@contextlib.contextmanager
def checkpoint(rank: int = 0, world_size: int = 1, *, quiet: bool = False) -> Iterator[Path]:
    """Write this process's part of the requested checkpoint into the directory it yields; when the block
    ends without error the part is marked done, and rank 0 creates COMPLETE once every rank's part is
    (:func:`done`). If the supervisor withdrew the request meanwhile, the write is abandoned quietly
    (one line on stderr) and the workload goes on: a late checkpoint is no reason to stop training."""
    global _answered
    n, d = request(), checkpoint_dir()
    if not n or d is None:
        raise RuntimeError("no checkpoint is requested now: check requested() first")
    try:
        yield d
        done(n, rank, world_size)
    except (OSError, Abandoned) as e:
        if request() == n and not isinstance(e, Abandoned):
            raise  # still requested: the error is the workload's own (a full disk, a bad path)
        if not quiet:
            print(f"cedana: checkpoint request {n} was withdrawn while rank {rank} wrote it; going on", file=sys.stderr)
    finally:
        _answered = max(_answered, n)


def done(n: int, rank: int = 0, world_size: int = 1) -> None:
    """Mark this rank's part of request ``n`` written; rank 0 then waits (until the request's deadline)
    for every rank's marker and creates COMPLETE. Raises Abandoned when the request is withdrawn first."""
    d = checkpoint_dir()
    if d is None:
        return
    _write_marker(d / f"{DONE_PREFIX}{rank}", str(n))
    if rank != 0:
        return
    deadline = _deadline()
    while True:
        have = sum(1 for r in range(world_size) if _marker(d / f"{DONE_PREFIX}{r}") == str(n))
        if have == world_size:
            break
        if request() != n or time.time() > deadline:
            raise Abandoned(f"request {n}: {have} of {world_size} ranks finished before it was withdrawn")
        time.sleep(0.01)
    if request() != n:  # withdrawn while the last marker landed: the directory may be gone already
        raise Abandoned(f"request {n} was withdrawn")
    _write_marker(d / COMPLETE, "")


def _deadline() -> float:
    try:
        with open(os.environ[ENV_REQUEST], "rb") as f:
            return float(json.loads(f.read())["deadline"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def _marker(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _write_marker(path: Path, text: str) -> None:
    """A marker appears whole or not at all (written aside, then renamed into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

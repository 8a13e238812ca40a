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
* The workload writes its state into the request's ``dir`` (a fresh, empty directory per request;
  ``CEDANA_CHECKPOINT_DIR`` names it too while the request is open), then creates the file
  ``COMPLETE`` in it (empty, or holding N). Nothing written after COMPLETE, or after the deadline, is kept.
* Several processes: each writes its part, then ``.done-<rank>`` (holding N); the one of rank 0 waits
  for every rank's and creates COMPLETE. A rank that never finishes means no checkpoint, never half of one.
* On a retry the latest checkpoint's files are in ``CEDANA_RESTORE_DIR`` before the command starts.
* ``CEDANA_CHECKPOINT_READY``: a file the workload creates once it can answer, with the PIDs that
  answer, one per line (``listen()`` adds its own); ``mode = auto`` on a node without CRIU asks only a
  workload that created it, and the signal then goes only to the PIDs in it.

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
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

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


class Abandoned(Exception):
    """The supervisor withdrew the request (its deadline passed, the run is stopping) while this
    process was still writing: nothing of it is kept, and the workload should simply go on."""


def restore_dir() -> Path | None:
    """The restored state's directory on a resume; None on a fresh start or outside a supervised run."""
    d = os.environ.get(ENV_RESTORE)
    return Path(d) if d else None


def checkpoint_dir() -> Path | None:
    """Where the open request's checkpoint is written (its own directory); None when none is open, or
    outside a supervised run."""
    doc = _request_doc()
    return Path(doc.dir) if doc else None


def listen() -> None:
    """Declare that this process answers requests: the signal now only sets a flag (its default action
    would end the process; interrupted system calls restart), and this PID goes into the ready file,
    which tells ``mode = auto`` it may ask. Call it once, early, from the main thread (Python's rule for
    signal handlers); elsewhere only the ready file is written."""
    name = os.environ.get(ENV_SIGNAL, "none")
    if name != "none" and threading.current_thread() is threading.main_thread():
        signum = getattr(signal, name)
        # A handler only keeps the default action (the process's end) away: the request file says what is asked.
        signal.signal(signum, lambda s, frame: None)
        signal.siginterrupt(signum, False)  # C extensions in a blocking call must not see EINTR
    if ready := os.environ.get(ENV_READY):
        with contextlib.suppress(OSError), open(ready, "a") as f:
            f.write(f"{os.getpid()}\n")


class _Request(NamedTuple):
    n: int
    dir: str
    deadline: float


def _request_doc() -> _Request | None:
    """The open request as its file says, or None (none open, or the file being replaced this instant)."""
    path = os.environ.get(ENV_REQUEST)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        return _Request(int(doc["request"]), str(doc["dir"]), float(doc["deadline"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def request() -> int:
    """The open request's number, 0 when none is open (or this process answered it already)."""
    return _unanswered(_request_doc())


def _unanswered(doc: _Request | None) -> int:
    return doc.n if doc and doc.n > _answered else 0


def requested() -> bool:
    """Whether the supervisor asks for a checkpoint now. Cheap (one small file read): call it at every
    step boundary. Each process of a multi-process job sees the request on its own, maybe at another
    step: ranks that must checkpoint the same step agree first (cedana_airflow.coop.torch does)."""
    return request() > 0


@contextlib.contextmanager
def checkpoint(rank: int = 0, world_size: int = 1, *, n: int | None = None, quiet: bool = False) -> Iterator[Path]:
    """Write this process's part of request ``n`` (default: the open one) into the directory it yields;
    when the block ends without error the part is marked done, and rank 0 creates COMPLETE once every
    rank's part is (:func:`done`). If the supervisor withdrew the request meanwhile (its deadline passed,
    the run is stopping), whatever failed is forgiven: one line on stderr, and the workload goes on. A
    late checkpoint is no reason to stop training; an error while the request stands is raised."""
    global _answered
    doc = _request_doc()
    n = n or _unanswered(doc)
    if not n:
        raise RuntimeError("no checkpoint is requested now: check requested() first")
    if not doc or doc.n < n:  # ranks on another node saw it first (a job's parts ask together): ours opens now
        doc = _awaited(n)
    if not doc or doc.n != n:
        # Withdrawn since it was seen: the caller's writes go to a directory nobody keeps.
        with tempfile.TemporaryDirectory(prefix="cedana-withdrawn-") as scratch:
            if not quiet:
                print(f"cedana: checkpoint request {n} was withdrawn before rank {rank} wrote it; going on",
                      file=sys.stderr)
            _answered = max(_answered, n)
            yield Path(scratch)
        return
    try:
        d = Path(doc.dir)
        yield d
        done(n, rank, world_size, d)
    except Exception as e:
        if _request_doc() == doc and not isinstance(e, Abandoned):
            raise  # still requested: the error is the workload's own (a full disk, a bug)
        if not quiet:
            print(f"cedana: checkpoint request {n} was withdrawn while rank {rank} wrote it ({type(e).__name__}); "
                  "going on", file=sys.stderr)
    finally:
        _answered = max(_answered, n)


#: How long a rank waits for its own supervisor's request that ranks on another node already answer.
AWAIT_SECONDS = 30.0


def _awaited(n: int) -> _Request | None:
    """The request ``n`` once this process's supervisor opens it, or None (not within AWAIT_SECONDS)."""
    until = time.monotonic() + AWAIT_SECONDS
    while time.monotonic() < until:
        doc = _request_doc()
        if doc is not None and doc.n >= n:
            return doc
        time.sleep(0.01)
    return None


def done(n: int, rank: int = 0, world_size: int = 1, d: Path | None = None) -> None:
    """Mark this rank's part of request ``n`` written (in ``d``, default the open request's directory);
    rank 0 then waits (until the request's deadline) for every rank's marker and creates COMPLETE.
    Raises Abandoned when the request is withdrawn first."""
    d = d or checkpoint_dir()
    if d is None:
        raise Abandoned(f"request {n} is no longer open")
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
    _write_marker(d / COMPLETE, str(n))  # its number: a COMPLETE that lands late is never taken for another's


def _deadline() -> float:
    doc = _request_doc()
    return doc.deadline if doc else 0.0


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

"""Checkpoint triggers: what makes a running workload checkpoint now, without stopping it.

- :class:`Heartbeat`: a checkpoint on a schedule. Heartbeats never overlap: the next interval starts
  when the previous checkpoint is stored.
- :class:`MemoryWatch`: the "memory above" policy trigger. A tree that is growing is about to cost
  more to checkpoint, or to be OOM-killed: one checkpoint as it crosses ``threshold`` bytes (resident
  plus GPU memory, as estimate.py counts it) saves the work done so far. It fires once per crossing
  and re-arms when memory falls below 90 % of the threshold.

A failed trigger is logged and the workload keeps running; the previous checkpoint stays the latest.
:class:`Failures` says each kind of failure once and counts the rest: a workload that cannot be
checkpointed (a socket CRIU cannot carry, a full disk) fails every heartbeat the same way, and one
line repeated every interval buries the task log.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CedanaError

__all__ = ["Failures", "Heartbeat", "MemoryWatch"]

log = logging.getLogger(__name__)


@dataclass
class FailureKind:
    cause: str  # the latest line of this kind
    count: int = 0


#: Failures said again after this many of the same kind (1 is the first): still failing, not forgotten.
_SAY_AGAIN_AT = (10, 100, 1000, 10000)


class Failures:
    """Failed checkpoints by kind (the line with its numbers taken out: a pid, a size, a seq). The first
    of a kind is said at WARNING, the same again only counted (and said at 10, 100, ...); a checkpoint
    that succeeds after failures says how many came before it. ``record(why)`` runs at each failure
    (the store index's count: the ID page shows it)."""

    def __init__(self, record: Callable[[str], object] | None = None) -> None:
        self._record = record
        self._lock = threading.Lock()
        self.kinds: dict[str, FailureKind] = {}
        self.total = 0
        self.last = ""
        self._since_success = 0

    @staticmethod
    def kind_of(why: str) -> str:
        return re.sub(r"\d+(\.\d+)?", "N", why)

    def failed(self, what: str, why: str, *, ending: bool = False) -> None:
        """``what`` failed (``heartbeat``, ``threshold checkpoint``) because of ``why``. ``ending``: the
        workload ended under it, which is said but is no failure of the checkpoint."""
        if ending:
            log.warning("%s failed as the workload ended (the previous checkpoint stays the latest): %s", what, why)
            return
        with self._lock:
            k = self.kinds.setdefault(self.kind_of(why), FailureKind(why))
            k.cause, k.count = why, k.count + 1
            self.total, self.last, self._since_success = self.total + 1, why, self._since_success + 1
            n = k.count
        if n == 1:
            log.warning("%s failed; the workload keeps running: %s", what, why)
        elif n in _SAY_AGAIN_AT:
            log.warning("%s failed the same way %d times now (said in full the first time); the workload keeps "
                        "running: %s", what, n, why)
        else:
            log.debug("%s failed the same way again (%d): %s", what, n, why)
        if self._record is not None:
            try:
                self._record(why)
            except Exception as e:  # noqa: BLE001 - the count in the store is a courtesy; the store may be the failure
                log.debug("heartbeat failure not recorded in the store: %s", e)

    def succeeded(self) -> None:
        with self._lock:
            n, self._since_success = self._since_success, 0
        if n:
            log.info("checkpoint taken after %d failed heartbeat(s); last failure: %s", n, self.last)

    def as_json(self) -> list[dict[str, object]]:
        """Each kind, most frequent first: its latest line and how often (``run --json``, the XCom summary)."""
        with self._lock:
            return [{"cause": k.cause, "count": k.count} for k in sorted(self.kinds.values(), key=lambda k: -k.count)]


class Heartbeat(threading.Thread):
    """``interval``: seconds, or a callable asked before each wait (heartbeat = auto: run/cadence.py)."""

    def __init__(self, interval: float | Callable[[], float], beat: Callable[[], object],
                 alive: Callable[[], bool] | None = None, failures: Failures | None = None) -> None:
        super().__init__(name="cedana-heartbeat", daemon=True)
        self._interval = interval
        self._beat = beat
        self._alive = alive  # is the workload still there? (a dump fails when it ends under it)
        self.failures = failures if failures is not None else Failures()
        self._halt = threading.Event()

    @property
    def interval(self) -> float:
        return self._interval() if callable(self._interval) else self._interval

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self._beat()
            except CedanaError as e:
                self._failed(str(e))
            except OSError as e:  # the node's own trouble (a full disk, an I/O error): the cause and the fix
                self._failed(os_error_line(e))
            except Exception:  # a bug in a heartbeat must not take the workload down either
                log.exception("heartbeat failed unexpectedly; the workload keeps running")
            else:
                self.failures.succeeded()

    def _failed(self, why: str) -> None:
        self.failures.failed("heartbeat", why, ending=self._alive is not None and not self._alive())

    def stop(self, wait: bool = True) -> None:
        self._halt.set()
        if wait and self.is_alive() and threading.current_thread() is not self:
            self.join()


def os_error_line(e: OSError) -> str:
    """An OSError of a heartbeat as one line: what failed, where, and the fix when there is a usual one."""
    where = f" ({e.filename})" if e.filename else ""
    fix = {errno.ENOSPC: "; free space there or point CEDANA_WORK_DIR at a larger disk",
           errno.EDQUOT: "; raise the quota or point CEDANA_WORK_DIR elsewhere",
           errno.EROFS: "; point CEDANA_WORK_DIR at a writable file system"}.get(e.errno or 0, "")
    return f"{e.strerror or e}{where}{fix}"


class MemoryWatch(threading.Thread):
    def __init__(self, threshold: int, sample: Callable[[], int], fire: Callable[[], object],
                 poll_seconds: float = 0.5, failures: Failures | None = None) -> None:
        super().__init__(name="cedana-memory-watch", daemon=True)
        self.threshold, self.poll_seconds = threshold, poll_seconds
        self._sample, self._fire = sample, fire
        self.failures = failures if failures is not None else Failures()
        self._halt = threading.Event()
        self.fired = 0

    def run(self) -> None:
        armed = True
        while not self._halt.wait(self.poll_seconds):
            used = self._sample()
            if armed and used > self.threshold:
                armed = False
                self.fired += 1
                log.info("memory above threshold: %d > %d bytes; checkpoint now", used, self.threshold)
                try:
                    self._fire()
                except CedanaError as e:
                    self.failures.failed("threshold checkpoint", str(e))
                except Exception:
                    log.exception("threshold checkpoint failed unexpectedly; the workload keeps running")
            elif not armed and used < 0.9 * self.threshold:
                armed = True

    def stop(self, wait: bool = True) -> None:
        self._halt.set()
        if wait and self.is_alive() and threading.current_thread() is not self:
            self.join()

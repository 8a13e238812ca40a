"""Checkpoint triggers: what makes a running workload checkpoint now, without stopping it.

- :class:`Heartbeat`: a checkpoint on a schedule. Heartbeats never overlap: the next interval starts
  when the previous checkpoint is stored.
- :class:`MemoryWatch`: the "memory above" policy trigger. A tree that is growing is about to cost
  more to checkpoint, or to be OOM-killed: one checkpoint as it crosses ``threshold`` bytes (resident
  plus GPU memory, as estimate.py counts it) saves the work done so far. It fires once per crossing
  and re-arms when memory falls below 90 % of the threshold.

A failed trigger is logged and the workload keeps running; the previous checkpoint stays the latest.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable

from ..errors import CedanaError

__all__ = ["Heartbeat", "MemoryWatch"]

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    """``interval``: seconds, or a callable asked before each wait (heartbeat = auto: run/cadence.py)."""

    def __init__(self, interval: float | Callable[[], float], beat: Callable[[], object],
                 alive: Callable[[], bool] | None = None) -> None:
        super().__init__(name="cedana-heartbeat", daemon=True)
        self._interval = interval
        self._beat = beat
        self._alive = alive  # is the workload still there? (a dump fails when it ends under it)
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

    def _failed(self, why: str) -> None:
        if self._alive is not None and not self._alive():
            log.warning("heartbeat failed as the workload ended (the previous checkpoint stays the latest): %s", why)
        else:
            log.warning("heartbeat failed; the workload keeps running: %s", why)

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
                 poll_seconds: float = 0.5) -> None:
        super().__init__(name="cedana-memory-watch", daemon=True)
        self.threshold, self.poll_seconds = threshold, poll_seconds
        self._sample, self._fire = sample, fire
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
                    log.warning("threshold checkpoint failed; the workload keeps running: %s", e)
                except Exception:
                    log.exception("threshold checkpoint failed unexpectedly; the workload keeps running")
            elif not armed and used < 0.9 * self.threshold:
                armed = True

    def stop(self, wait: bool = True) -> None:
        self._halt.set()
        if wait and self.is_alive() and threading.current_thread() is not self:
            self.join()

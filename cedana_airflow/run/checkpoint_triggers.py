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

import logging
import threading
from collections.abc import Callable

from ..errors import CedanaError

__all__ = ["Heartbeat", "MemoryWatch"]

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    def __init__(self, interval: float, beat: Callable[[], object]) -> None:
        super().__init__(name="cedana-heartbeat", daemon=True)
        self.interval = interval
        self._beat = beat
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self._beat()
            except CedanaError as e:
                log.warning("heartbeat failed; the workload keeps running: %s", e)
            except Exception:  # a bug in a heartbeat must not take the workload down either
                log.exception("heartbeat failed unexpectedly; the workload keeps running")

    def stop(self, wait: bool = True) -> None:
        self._halt.set()
        if wait and self.is_alive() and threading.current_thread() is not self:
            self.join()


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

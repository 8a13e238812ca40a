"""The heartbeat: a checkpoint on a schedule while the workload keeps running.

A failed heartbeat is logged and the workload keeps running; the previous checkpoint stays the
latest. Heartbeats never overlap: the next interval starts when the previous checkpoint is stored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .errors import CedanaError

__all__ = ["Heartbeat"]

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

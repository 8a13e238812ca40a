"""A stop that a signal handler may request: an Event whose set() takes no lock.

Python runs a signal's handler in the main thread between two bytecodes, and a second signal's handler
can run inside the first's. ``threading.Event.set()`` takes the event's lock, which is not reentrant:
a second SIGTERM arriving while the first handler is inside ``set()`` waits for ever on a lock its own
thread holds. It happens: Airflow's task supervisor signals a run_as_user task's process group, and
sudo (with no terminal, its command stays in that group) relays the same SIGTERM about 60 µs later,
so the task process can get two (CI of 2026-12-06: the task hung in on_kill, its workload ran on until
Airflow's SIGKILL, and no final checkpoint was taken). Here ``set()`` is one attribute store, atomic
under the GIL, and a waiter polls.
"""
from __future__ import annotations

import threading
import time

#: How often a waiter looks again (a stop is acted on within this; nobody waits on it in a hot loop).
POLL_SECONDS = 0.05


class SignalSafeEvent(threading.Event):
    """A ``threading.Event`` for stops requested from signal handlers: ``set()``, ``is_set()`` and
    ``clear()`` take no lock (they keep the base class's flag, so its repr stays true); ``wait()`` polls
    every POLL_SECONDS instead of being woken."""

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            if deadline is None:
                time.sleep(POLL_SECONDS)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(POLL_SECONDS, left))
        return True

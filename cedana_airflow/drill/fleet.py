"""The running Airflow tasks a drill acts on, as the core sees them: no Airflow import here.

The Airflow side implements :class:`Fleet` over Airflow's REST API (airflow/live_fleet.py); the live
drill (live.py) and the failover demo drive it, and follow.py measures what happens after a failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

__all__ = ["FAILED", "FINISHED", "Fleet", "RunningTask", "TaskNow", "utc", "wait"]

#: Airflow states after which a try no longer runs.
FINISHED = frozenset({"success", "failed", "upstream_failed", "skipped", "removed"})
#: ...and those that show Airflow has seen a try fail (a retry is coming, or it failed for good).
FAILED = frozenset({"failed", "up_for_retry", "upstream_failed"})


class RunningTask(BaseModel):
    """A running task instance as the fleet lists it."""

    model_config = ConfigDict(frozen=True)

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1
    try_number: int
    max_tries: int  # the retries it was given (Airflow's max_tries): the last try is max_tries + 1
    pool: str = ""
    queue: str = ""
    hostname: str = ""

    def key(self) -> tuple[str, str, str, int]:
        return self.dag_id, self.task_id, self.run_id, self.map_index


class TaskNow(BaseModel):
    """A task instance's current try, as the fleet reports it."""

    model_config = ConfigDict(frozen=True)

    state: str | None
    try_number: int
    start_date: datetime | None = None
    hostname: str = ""  # the worker running (or that last ran) this try


class Fleet(Protocol):
    def stop_reason(self) -> str | None:
        """Why live drills must stop now (a kill switch is on), or None."""

    def running_tasks(self) -> list[RunningTask]: ...

    def fail_try(self, task: RunningTask, note: str) -> None: ...

    def clear(self, task: RunningTask) -> None:
        """What the UI's Clear does: a new try of the (failed) task."""

    def now(self, task: RunningTask) -> TaskNow: ...

    def output(self, task: RunningTask, try_number: int) -> list[tuple[datetime, str]]:
        """The try's task log lines written by the task itself (the workload's output and ours), timed."""


T = TypeVar("T")


def wait(what: Callable[[], T | None], until: float, poll: float) -> T | None:
    """Call ``what`` until it returns something (not None) or the monotonic deadline passes."""
    while True:
        got = what()
        if got is not None or time.monotonic() >= until:
            return got
        time.sleep(poll)


def utc() -> datetime:
    return datetime.now(timezone.utc)

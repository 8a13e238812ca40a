"""What a task instance remembers across its tries, in Airflow's task state store.

``context["task_state_store"]`` survives retries and Clear (DESIGN.md), so it is where a try finds
out where earlier tries ran: the command operator warns (or fails fast) when a retry lands on the
node where the previous try failed, and the pod operator keeps a retry's pod off those nodes. Both
keep one record under one key:

    {"checkpoint_id": ..., "tries": [{"try_number": 1, "node": "gpu-7", "started_at": ..., "ended": "killed SIGKILL"},
                                     ...],
     "latest_seq": 3, "last_restore": {...}}

Bookkeeping never fails a workload: a store that cannot be read or written is logged and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from ..format.manifest import AirflowTask
from .logsink import TaskLog

__all__ = ["STATE_KEY", "TaskState", "airflow_task"]

#: Key in ``context["task_state_store"]``.
STATE_KEY = "cedana"
#: Tries remembered; a task retried more often than this forgets its oldest nodes.
_KEEP_TRIES = 20


class TaskState:
    """The record of one task instance, read once and written back after each change."""

    def __init__(self, store: Any, log: TaskLog) -> None:
        self._store, self._log = store, log
        self.record: dict[str, Any] = self._load()

    @classmethod
    def of(cls, context: Mapping[str, Any], log: TaskLog) -> TaskState:
        return cls(context.get("task_state_store"), log)

    @property
    def kept(self) -> bool:
        """Whether this Airflow keeps the record across tries (its task state store came in 3.3)."""
        return self._store is not None

    @property
    def tries(self) -> list[dict[str, Any]]:
        return list(self.record.get("tries") or [])

    def previous_try(self, try_number: int) -> dict[str, Any] | None:
        """The latest try other than ``try_number``, or None on a first try."""
        return next((t for t in reversed(self.tries) if t.get("try_number") != try_number), None)

    def earlier_nodes(self, try_number: int) -> tuple[str, ...]:
        """The nodes where other tries ran, oldest first, each once."""
        return tuple(dict.fromkeys(t["node"] for t in self.tries if t.get("try_number") != try_number and t.get("node")))

    def add_try(self, try_number: int, node: str, **fields: Any) -> None:
        """Remember that ``try_number`` runs on ``node``; ``fields`` update the record in the same write."""
        tries = [*self.tries, {"try_number": try_number, "node": node,
                               "started_at": datetime.now(timezone.utc).isoformat()}]
        self.update(tries=tries[-_KEEP_TRIES:], **fields)

    def ended(self, try_number: int, how: str) -> list[dict[str, Any]]:
        """The tries, with ``try_number``'s end (``"exited 0"``, ``"killed SIGKILL"``, ``"stopped SIGTERM"``)."""
        return [{**t, "ended": how} if t.get("try_number") == try_number else t for t in self.tries]

    def update(self, **fields: Any) -> None:
        self.record.update(fields)
        if self._store is None:
            return
        try:
            self._store.set(STATE_KEY, self.record)
        except Exception as e:  # bookkeeping must never fail the workload
            self._log.warning("cedana: could not write the task state store: %s", e)

    def _load(self) -> dict[str, Any]:
        if self._store is None:
            return {}
        try:
            return dict(self._store.get(STATE_KEY) or {})
        except Exception as e:  # bookkeeping must never fail the workload
            self._log.warning("cedana: could not read the task state store: %s", e)
            return {}


def airflow_task(context: Mapping[str, Any]) -> AirflowTask:
    """The task instance a context is, as manifests and restore records name it."""
    ti = context["ti"]
    return AirflowTask(dag_id=ti.dag_id, task_id=ti.task_id, run_id=context["run_id"],
                       map_index=ti.map_index if ti.map_index is not None else -1)

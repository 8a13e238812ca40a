"""What Airflow's own history says about a task, read through its public REST API (airflow/api.py).

Two questions, both asked when a try starts:

- **How often does this kind of work fail from outside?** (``heartbeat = auto``, run/cadence.py.) The
  tries of the task instances of the same queue (and pool, when not the default one) started in the
  last ``failure_window_days``, each classified by how it ended (:func:`classify`); their run time is
  the exposure the failures are counted in.
- **How long does this task take?** (the opt-in list's short-task rule, when ``expected_duration`` is
  not declared.) The median over its last ``learned_duration_runs`` successful task instances of the
  run time of all their tries: a resumed task's last try alone would look short.

How a try ended comes from what Airflow recorded, never from our store:

========================  ==========================================================================
Airflow recorded           the try ended by
========================  ==========================================================================
``heartbeat timeout``      node-loss: the try stopped heartbeating (its node, its worker or its process died)
``state mismatch``         killed: the executor saw its process gone before it said how it ended
a user's state change      user: someone marked it failed or cleared it (a live drill does that too)
the task's own record      killed (a signal nobody of ours sent: the OOM killer, an Xid's kill) or
                           stopped (SIGTERM from a drain or a preemption), kept by our operators in
                           the task state store, which Airflow keeps across tries
``failed``/``up_for_retry`` workload: the task itself reported the failure (its own code)
no word at all             lost: failed, and nothing said so: the process did not survive to say
========================  ==========================================================================

node-loss, killed, stopped and lost count as failures; workload, user and success do not. A history that
cannot be read never fails a task: it says why in one line, and the prior (``mtbf_hours``) stands alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Literal
from urllib.parse import quote, urlencode

from ..config import FailureHistory
from ..errors import CedanaError
from .api import AirflowApi
from .config import AirflowOptions, airflow_options

__all__ = ["AirflowHistory", "Ending", "INFRASTRUCTURE", "LearnedDuration", "TryEnd", "classify", "failure_history", "learned_duration"]

Ending = Literal["success", "node-loss", "killed", "stopped", "lost", "workload", "user", "running"]
#: Endings that are not the workload's doing: what a checkpoint protects against.
INFRASTRUCTURE: frozenset[str] = frozenset({"node-loss", "killed", "stopped", "lost"})

#: Task instances examined try by try (their tries and events read), the most recent first.
MAX_EXAMINED = 200
#: Task instances of the queue listed at most (the most recent first).
MAX_LISTED = 5000
_UNFINISHED = {"running", "queued", "scheduled", "deferred", "up_for_reschedule", "restarting", None}
#: Audit-log events of a person (or a drill) changing a task's state by hand.
_USER_EVENTS = ("patch_task_instance", "post_clear_task_instances", "patch_task_instances", "clear")


@dataclass(frozen=True)
class TryEnd:
    """One try and how it ended."""

    dag_id: str
    task_id: str
    run_id: str
    map_index: int
    try_number: int
    state: str | None
    seconds: float
    ending: Ending


def classify(state: str | None, events: Collection[str], ended: str | None = None) -> Ending:
    """How one try ended, from its final state, the audit-log events Airflow wrote for it and, for a
    failure the task reported itself, what our operator recorded (``ended``: "killed SIGKILL", "stopped
    SIGTERM", "exit 3")."""
    if "heartbeat timeout" in events:
        return "node-loss"
    if "state mismatch" in events:
        return "killed"
    if state == "success" or "success" in events:
        return "success"
    if any(e.startswith(_USER_EVENTS) for e in events):
        return "user"
    if state in _UNFINISHED and not {"failed", "up_for_retry"} & set(events):
        return "running"
    if ended and ended.startswith("killed"):
        return "killed"
    if ended and ended.startswith("stopped"):
        return "stopped"
    if ended or {"failed", "up_for_retry"} & set(events):
        return "workload"
    return "lost"


def failure_history(api: AirflowApi, *, queue: str, pool: str, window_days: float,
                    now: datetime | None = None) -> FailureHistory:
    """The failures (INFRASTRUCTURE endings) and run time of the tries of this queue's (and pool's) task
    instances started in the window."""
    now = now or datetime.now(timezone.utc)
    since = now - timedelta(days=window_days)
    where = {"queue": queue, **({"pool": pool} if pool and pool != "default_pool" else {})}
    scope = ", ".join(f"{k} {v}" for k, v in where.items())
    tis = api.pages("/api/v2/dags/~/dagRuns/~/taskInstances", "task_instances",
                    {**where, "start_date_gte": since.isoformat(), "order_by": "-start_date"}, cap=MAX_LISTED)
    ends: list[TryEnd] = []
    examined = skipped = 0
    for ti in tis:  # the most recent first
        latest = _try_of(ti, now)
        if ti.get("try_number", 1) <= 1 and latest.state in ("success", *_UNFINISHED):
            ends.append(latest)  # one try that succeeded, or runs: nothing to classify
        elif examined < MAX_EXAMINED:
            examined += 1
            ends += tries_of(api, ti, now)
        else:
            skipped += 1
    failures = sum(1 for e in ends if e.ending in INFRASTRUCTURE)
    note = f"only the latest {MAX_EXAMINED} retried task instances were examined" if skipped > 0 else ""
    return FailureHistory(failures=failures, exposure_seconds=round(sum(e.seconds for e in ends), 1), tries=len(ends),
                          window_days=window_days, scope=scope, note=note)


def _tries(api: AirflowApi, ti: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """Every try of one task instance as Airflow keeps it (its history, and the current try), by number."""
    got = api.call("GET", f"{_ti_path(ti)}/tries", missing_ok=True) or {}
    rows = {r["try_number"]: r for r in got.get("task_instances") or [] if r.get("try_number")}
    rows.setdefault(ti.get("try_number", 1), dict(ti))
    return rows


def tries_of(api: AirflowApi, ti: Mapping[str, Any], now: datetime) -> list[TryEnd]:
    """Every try of one task instance, each classified."""
    rows = _tries(api, ti)
    events = _events(api, ti)
    ended = _recorded_ends(api, ti) if any(r.get("state") not in ("success", *_UNFINISHED) for r in rows.values()) else {}
    out = []
    for n, r in sorted(rows.items()):
        t = _try_of({**ti, **r}, now)
        out.append(TryEnd(t.dag_id, t.task_id, t.run_id, t.map_index, n, t.state, t.seconds,
                          classify(r.get("state"), events.get(n, set()), ended.get(n))))
    return out


@dataclass(frozen=True)
class LearnedDuration:
    seconds: float
    runs: int


def learned_duration(api: AirflowApi, dag_id: str, task_id: str, runs: int) -> LearnedDuration | None:
    """The median run time (all tries) of the task's last ``runs`` successful task instances; None for none."""
    if runs <= 0:
        return None
    got = api.call("GET", f"/api/v2/dags/{quote(dag_id, safe='')}/dagRuns/~/taskInstances?" + urlencode(
        {"task_id": task_id, "state": "success", "order_by": "-end_date", "limit": runs}))
    totals = []
    now = datetime.now(timezone.utc)
    for ti in (got or {}).get("task_instances") or []:
        tries = _tries(api, ti).values() if ti.get("try_number", 1) > 1 else [ti]
        totals.append(sum(_try_of({**ti, **t}, now).seconds for t in tries))
    return LearnedDuration(statistics.median(totals), len(totals)) if totals else None


class AirflowHistory:
    """One try's questions to Airflow's history: one login, made when first needed; a history that cannot be
    read is said once in the task log and never fails the task."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._api: AirflowApi | None = None
        self._broken = ""
        self._options: AirflowOptions | None = None

    @property
    def options(self) -> AirflowOptions:
        if self._options is None:
            self._options = airflow_options("history_api_url", "history_api_conn_id", "drill_api_url",
                                            "drill_api_conn_id", "failure_window_days", "learned_duration_runs")
        return self._options

    def _client(self) -> AirflowApi | None:
        if self._api is None and not self._broken:
            try:
                o = self.options
                self._api = AirflowApi(o.history_api_url or o.drill_api_url,
                                       o.history_api_conn_id or o.drill_api_conn_id, option="history_api_conn_id",
                                       denied_fix="Give the user of [cedana] history_api_conn_id read access to task "
                                       "instances and the audit log.")
            except Exception as e:  # what cannot be read is said, never raised
                self._broken = _line(e)
                self.log.warning("cedana: Airflow's history cannot be read: %s", self._broken)
        return self._api

    def duration(self, dag_id: str, task_id: str) -> tuple[float | None, str]:
        """The learned duration and how it was learned, or None and why not."""
        try:
            if self.options.learned_duration_runs == 0:
                return None, "learned_duration_runs = 0 and no expected_duration declared"
            api = self._client()
            if api is None:
                return None, f"no expected_duration declared, and Airflow's history cannot be read ({self._broken})"
            got = learned_duration(api, dag_id, task_id, self.options.learned_duration_runs)
        except Exception as e:
            self.log.warning("cedana: this task's past durations cannot be read: %s", _line(e))
            return None, f"no expected_duration declared, and its past durations cannot be read ({_line(e)})"
        if got is None:
            return None, "no expected_duration declared, and no successful run of it yet"
        return got.seconds, f"learned: the median of its last {got.runs} successful run{'s' if got.runs > 1 else ''}"

    def failures(self, queue: str, pool: str) -> FailureHistory:
        """This queue's failure history; an empty one (saying why) when it cannot be read."""
        scope = f"queue {queue}"
        try:
            window = self.options.failure_window_days
            api = self._client()
            if api is None:
                return FailureHistory(window_days=window, scope=scope, note=f"history not read: {self._broken}")
            return failure_history(api, queue=queue, pool=pool, window_days=window)
        except Exception as e:
            self.log.warning("cedana: the failure history of %s cannot be read: %s", scope, _line(e))
            return FailureHistory(scope=scope, note=f"history not read: {_line(e)}")


def _line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text.removeprefix("cedana: ")[:300]


# -- reading -------------------------------------------------------------------------------------------------
def _ti_path(ti: Mapping[str, Any]) -> str:
    path = (f"/api/v2/dags/{quote(ti['dag_id'], safe='')}/dagRuns/{quote(ti['dag_run_id'], safe='')}/taskInstances/"
            f"{quote(ti['task_id'], safe='')}")
    return path + (f"/{ti['map_index']}" if ti.get("map_index", -1) >= 0 else "")


def _try_of(r: Mapping[str, Any], now: datetime) -> TryEnd:
    seconds, state = r.get("duration"), r.get("state")
    if seconds is None:  # an ended try without a duration: its dates; a running one: its time so far
        start, end = _when(r.get("start_date")), _when(r.get("end_date"))
        if start and (end or state in _UNFINISHED):
            seconds = ((end or now) - start).total_seconds()
    return TryEnd(r["dag_id"], r["task_id"], r.get("dag_run_id", ""), r.get("map_index", -1), r.get("try_number", 1),
                  state, max(float(seconds or 0.0), 0.0),
                  "success" if state == "success" else "running" if state in _UNFINISHED else "workload")


def _when(text: Any) -> datetime | None:
    return datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None


def _events(api: AirflowApi, ti: Mapping[str, Any]) -> dict[int, set[str]]:
    """The audit-log events of one task instance, by try. An event without a try number (a person's state
    change through the API) goes to the latest try begun before it."""
    q = {"dag_id": ti["dag_id"], "task_id": ti["task_id"], "run_id": ti["dag_run_id"], "order_by": "when"}
    rows = api.pages("/api/v2/eventLogs", "event_logs", q, cap=1000)
    by_try: dict[int, set[str]] = {}
    current = 0  # the latest try begun so far, in time order
    for e in rows:
        if e.get("map_index") not in (None, ti.get("map_index", -1)):
            continue
        n, event = e.get("try_number"), str(e.get("event"))
        if n and event == "running":
            current = max(current, n)
        by_try.setdefault(n or current or ti.get("try_number", 1), set()).add(event)
    return by_try


def _recorded_ends(api: AirflowApi, ti: Mapping[str, Any]) -> dict[int, str]:
    """How each try ended, as our operator recorded it in the task state store (task_state.py)."""
    q = f"?{urlencode({'map_index': ti['map_index']})}" if ti.get("map_index", -1) >= 0 else ""
    path = (f"/api/v2/dags/{quote(ti['dag_id'], safe='')}/dagRuns/{quote(ti['dag_run_id'], safe='')}/taskInstances/"
            f"{quote(ti['task_id'], safe='')}/state-store/cedana{q}")
    got = api.call("GET", path, missing_ok=True) or {}
    return _ends_from(got.get("value") if isinstance(got, dict) else None)


def _ends_from(record: Any) -> dict[int, str]:
    if not isinstance(record, dict):
        return {}
    tries: Iterable[Any] = record.get("tries") or []
    return {int(t["try_number"]): str(t["ended"]) for t in tries
            if isinstance(t, dict) and t.get("ended") and isinstance(t.get("try_number"), int)}

"""The live drill's view of the fleet (drill/live.py: Fleet), through Airflow's public REST API.

The drill task uses the API, not the metadata database (Airflow 3 tasks have no database access), so
it does exactly what a person could do in the UI (Mark as failed, Clear) with the permissions of the
user it logs in as (``[cedana] drill_api_conn_id``): a user who may edit only some DAGs can drill
only those. Its kill switch is an Airflow Variable (``[drills] kill_switch_variable``) or the drill
DAG paused; both are read before every action.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

from ..drill.fleet import RunningTask, TaskNow
from .api import AirflowApi

__all__ = ["ApiFleet"]

_OFF = {"", "0", "false", "no", "off"}


class ApiFleet(AirflowApi):
    def __init__(self, url: str | None, conn_id: str | None, drill_dag_id: str, kill_switch_variable: str) -> None:
        super().__init__(url, conn_id, option="drill_api_conn_id",
                         denied_fix="Give the drill's user (drill_api_conn_id) edit permission on this DAG.")
        self.drill_dag_id, self.kill_switch_variable = drill_dag_id, kill_switch_variable

    def _ti_path(self, t: RunningTask) -> str:
        path = f"/api/v2/dags/{quote(t.dag_id, safe='')}/dagRuns/{quote(t.run_id, safe='')}/taskInstances/{quote(t.task_id, safe='')}"
        return path + (f"/{t.map_index}" if t.map_index >= 0 else "")

    # -- Fleet -------------------------------------------------------------------------------------
    def stop_reason(self) -> str | None:
        from airflow.sdk import Variable

        value = Variable.get(self.kill_switch_variable, default=None)
        if value is not None and str(value).strip().lower() not in _OFF:
            return f"kill switch: Airflow Variable {self.kill_switch_variable} is set ({str(value)[:80]!r})"
        dag = self.call("GET", f"/api/v2/dags/{quote(self.drill_dag_id, safe='')}", missing_ok=True)
        if dag and dag.get("is_paused"):
            return f"kill switch: the {self.drill_dag_id} DAG is paused"
        return None

    def running_tasks(self) -> list[RunningTask]:
        rows = self.pages("/api/v2/dags/~/dagRuns/~/taskInstances", "task_instances", {"state": "running"})
        return [RunningTask(dag_id=r["dag_id"], task_id=r["task_id"], run_id=r["dag_run_id"],
                            map_index=r.get("map_index", -1), try_number=r["try_number"],
                            max_tries=r.get("max_tries", 0), pool=r.get("pool") or "", queue=r.get("queue") or "",
                            hostname=r.get("hostname") or "")
                for r in rows if r["dag_id"] != self.drill_dag_id]

    def fail_try(self, task: RunningTask, note: str) -> None:
        self.call("PATCH", self._ti_path(task), {"new_state": "failed", "note": note})

    def clear(self, task: RunningTask) -> None:
        # include_downstream: tasks the failure marked upstream_failed go back too; only_failed spares the
        # rest; reset_dag_runs takes the run out of "failed"
        self.call("POST", f"/api/v2/dags/{quote(task.dag_id, safe='')}/clearTaskInstances",
                   {"dry_run": False, "dag_run_id": task.run_id, "task_ids": [task.task_id] if task.map_index < 0
                    else [[task.task_id, task.map_index]], "only_failed": True, "include_downstream": True,
                    "reset_dag_runs": True})

    def now(self, task: RunningTask) -> TaskNow:
        r = self.call("GET", self._ti_path(task))
        start = r.get("start_date")
        return TaskNow(state=r.get("state"), try_number=r["try_number"], hostname=r.get("hostname") or "",
                       start_date=datetime.fromisoformat(start) if start else None)

    def output(self, task: RunningTask, try_number: int) -> list[tuple[datetime, str]]:
        q = {"full_content": "true", **({"map_index": task.map_index} if task.map_index >= 0 else {})}
        path = (f"/api/v2/dags/{quote(task.dag_id, safe='')}/dagRuns/{quote(task.run_id, safe='')}/taskInstances/"
                f"{quote(task.task_id, safe='')}/logs/{try_number}?{urlencode(q)}")
        got = self.call("GET", path, missing_ok=True) or {}
        out = []
        for e in got.get("content") or []:
            # the task's own lines: its operator logs them (the workload's output through LogSink, and ours)
            if isinstance(e, dict) and str(e.get("logger", "")).startswith("airflow.task.operators") and e.get("timestamp"):
                out.append((datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")), str(e.get("event", ""))))
        return out

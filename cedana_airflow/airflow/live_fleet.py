"""The live drill's view of the fleet (drill/live.py: Fleet), through Airflow's public REST API.

The drill task uses the API, not the metadata database (Airflow 3 tasks have no database access), so
it does exactly what a person could do in the UI (Mark as failed, Clear) with the permissions of the
user it logs in as (``[cedana] drill_api_conn_id``): a user who may edit only some DAGs can drill
only those. Its kill switch is an Airflow Variable (``[drills] kill_switch_variable``) or the drill
DAG paused; both are read before every action.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

from ..drill.fleet import RunningTask, TaskNow
from ..errors import CedanaError, ConfigError
from ..hooks.store import named_connection

__all__ = ["ApiFleet", "api_base_url"]

_OFF = {"", "0", "false", "no", "off"}


def api_base_url(option: str | None) -> str:
    """``[cedana] drill_api_url``, else the api-server this worker reports to."""
    if option:
        return option.rstrip("/")
    from airflow.configuration import conf

    execution = conf.get("core", "execution_api_server_url", fallback="") or ""
    if execution.rstrip("/").endswith("/execution"):
        return execution.rstrip("/")[: -len("/execution")]
    base = conf.get("api", "base_url", fallback="") or ""
    if not base:
        raise ConfigError("live drills need Airflow's API: set [cedana] drill_api_url (or [core] execution_api_server_url).")
    return base.rstrip("/")


class ApiFleet:
    def __init__(self, base_url: str, conn_id: str | None, drill_dag_id: str, kill_switch_variable: str) -> None:
        self.base, self.drill_dag_id, self.kill_switch_variable = base_url, drill_dag_id, kill_switch_variable
        self.token = self._login(conn_id)

    # -- the API ---------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *, token: str | None = None,
              missing_ok: bool = False) -> Any:
        token = token if token is not None else self.token
        req = urllib.request.Request(self.base + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if missing_ok and e.code == 404:
                return None
            detail = e.read().decode(errors="replace")[:300]
            fix = (" Give the drill's user (drill_api_conn_id) edit permission on this DAG." if e.code in (401, 403) else "")
            raise CedanaError(f"Airflow API {method} {path.split('?')[0]}: HTTP {e.code}: {detail}.{fix}") from None
        except OSError as e:
            raise CedanaError(f"Airflow API at {self.base} cannot be reached ({e}). Set [cedana] drill_api_url to "
                              "the api-server's address.") from None

    def _login(self, conn_id: str | None) -> str:
        if not conn_id:  # the simple auth manager in all-admins mode hands out a token
            got = self._call("GET", "/auth/token", token="")
        else:
            c = named_connection(conn_id, "[cedana] drill_api_conn_id", "to use the all-admins token")
            if tok := (c.extra_dejson or {}).get("token"):
                return str(tok)
            got = self._call("POST", "/auth/token", {"username": c.login, "password": c.password}, token="")
        try:
            return str(got["access_token"])
        except (TypeError, KeyError):
            raise ConfigError(f"Airflow API at {self.base} gave no token. Set [cedana] drill_api_conn_id to a "
                              "connection with the drill user's login and password.") from None

    def _ti_path(self, t: RunningTask) -> str:
        path = f"/api/v2/dags/{quote(t.dag_id, safe='')}/dagRuns/{quote(t.run_id, safe='')}/taskInstances/{quote(t.task_id, safe='')}"
        return path + (f"/{t.map_index}" if t.map_index >= 0 else "")

    # -- Fleet -------------------------------------------------------------------------------------
    def stop_reason(self) -> str | None:
        from airflow.sdk import Variable

        value = Variable.get(self.kill_switch_variable, default=None)
        if value is not None and str(value).strip().lower() not in _OFF:
            return f"kill switch: Airflow Variable {self.kill_switch_variable} is set ({str(value)[:80]!r})"
        dag = self._call("GET", f"/api/v2/dags/{quote(self.drill_dag_id, safe='')}", missing_ok=True)
        if dag and dag.get("is_paused"):
            return f"kill switch: the {self.drill_dag_id} DAG is paused"
        return None

    def running_tasks(self) -> list[RunningTask]:
        out: list[RunningTask] = []
        offset = 0
        while True:
            page = self._call("GET", "/api/v2/dags/~/dagRuns/~/taskInstances?"
                              + urlencode({"state": "running", "limit": 100, "offset": offset}))
            rows = page.get("task_instances", [])
            offset += len(rows)
            out += [RunningTask(dag_id=r["dag_id"], task_id=r["task_id"], run_id=r["dag_run_id"],
                                map_index=r.get("map_index", -1), try_number=r["try_number"],
                                max_tries=r.get("max_tries", 0), pool=r.get("pool") or "", queue=r.get("queue") or "",
                                hostname=r.get("hostname") or "")
                    for r in rows if r["dag_id"] != self.drill_dag_id]
            if not rows or offset >= page.get("total_entries", 0):
                return out

    def fail_try(self, task: RunningTask, note: str) -> None:
        self._call("PATCH", self._ti_path(task), {"new_state": "failed", "note": note})

    def clear(self, task: RunningTask) -> None:
        # include_downstream: tasks the failure marked upstream_failed go back too; only_failed spares the
        # rest; reset_dag_runs takes the run out of "failed"
        self._call("POST", f"/api/v2/dags/{quote(task.dag_id, safe='')}/clearTaskInstances",
                   {"dry_run": False, "dag_run_id": task.run_id, "task_ids": [task.task_id] if task.map_index < 0
                    else [[task.task_id, task.map_index]], "only_failed": True, "include_downstream": True,
                    "reset_dag_runs": True})

    def now(self, task: RunningTask) -> TaskNow:
        r = self._call("GET", self._ti_path(task))
        start = r.get("start_date")
        return TaskNow(state=r.get("state"), try_number=r["try_number"], hostname=r.get("hostname") or "",
                       start_date=datetime.fromisoformat(start) if start else None)

    def output(self, task: RunningTask, try_number: int) -> list[tuple[datetime, str]]:
        q = {"full_content": "true", **({"map_index": task.map_index} if task.map_index >= 0 else {})}
        path = (f"/api/v2/dags/{quote(task.dag_id, safe='')}/dagRuns/{quote(task.run_id, safe='')}/taskInstances/"
                f"{quote(task.task_id, safe='')}/logs/{try_number}?{urlencode(q)}")
        got = self._call("GET", path, missing_ok=True) or {}
        out = []
        for e in got.get("content") or []:
            # the task's own lines: its operator logs them (the workload's output through LogSink, and ours)
            if isinstance(e, dict) and str(e.get("logger", "")).startswith("airflow.task.operators") and e.get("timestamp"):
                out.append((datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")), str(e.get("event", ""))))
        return out

"""Airflow's own components on this machine: `airflow api-server`, `scheduler`, `dag-processor` and
`triggerer` (LocalExecutor; SQLite unless the env names another metadata DB). For `make demo`, `make ui`
and the end-to-end tests.

All four run, so Airflow's health (the UI's header, /api/v2/monitor/health) is green: a part that is
not running shows red there, with nothing saying why. The simple auth manager makes everyone an admin
here (a local demo needs no login), and the parts share one JWT secret, or the api-server would refuse
the task tokens the scheduler hands out. The stack is ready once every part is healthy and the DAG is
served. A part that does not come up is one line naming it and its log; every part is stopped on exit.

    with AirflowStack(env, home, wait_dag="cedana_demo_training") as stack:
        run_id = stack.call("POST", "/api/v2/dags/cedana_demo_training/dagRuns", {"logical_date": None})["dag_run_id"]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from local_parts import AIRFLOW, Deployment, free_port, stop_parts, tail  # (scripts/ is on sys.path)


def _last_error(log: Path) -> str:
    """The api-server's last logged error (other requests' lines come after it)."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-500:]
    except OSError:
        return f"(no log at {log})"
    errors = [x for x in lines if "[error" in x or "Error:" in x]
    return f"its last error: {errors[-1][-400:]} (log: {log})" if errors else f"no error in its log ({log})"


class StackError(RuntimeError):
    """A part of the deployment did not come up; the message names it and its log."""


#: The parts, each `airflow <part>` with its log at HOME/<part>.log.
PARTS = ("api-server", "scheduler", "dag-processor", "triggerer")


class AirflowStack(Deployment):
    def __init__(self, env: dict[str, str], home: Path, wait_dag: str, *, port: int = 0,
                 start_timeout: float = 180, airflow: list[str] | None = None) -> None:
        self.airflow = airflow or AIRFLOW  # the parts' CLI: another interpreter's (the worker environment's)
        self.port = free_port(port)
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "AIRFLOW__CORE__EXECUTOR": "LocalExecutor", "AIRFLOW__API__PORT": str(self.port),
                    "AIRFLOW__API__BASE_URL": self.base,
                    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
                    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                    "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                    "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": env.get("AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL", "5"),
                    # the scheduler's and the triggerer's log servers: their own ports, so that several
                    # stacks (tests run side by side) never fight over Airflow's 8793 and 8794
                    "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                    "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                    "AIRFLOW__API_AUTH__JWT_SECRET": env.get("AIRFLOW__API_AUTH__JWT_SECRET") or os.urandom(16).hex()}
        self.home, self.wait_dag, self.start_timeout = home, wait_dag, start_timeout
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.token = ""

    # -- lifecycle -----------------------------------------------------------------------------------
    def _up(self) -> None:
        # loopback only: everyone is an admin here, so nothing off this machine may reach it
        parts = [["api-server", "--host", "127.0.0.1", "--port", str(self.port)], *([p] for p in PARTS[1:])]
        for what in parts:
            with open(self.home / f"{what[0]}.log", "wb") as out:
                # cwd: the home, never a checkout, whose cedana_airflow/ a task re-executed by `python -c`
                # (run_as_user) would import before the installed package
                self.procs[what[0]] = subprocess.Popen([*self.airflow, *what], env=self.env, stdout=out, cwd=self.home,
                                                       stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    log = self.home / f"{name}.log"
                    raise StackError(f"airflow {name} exited {p.returncode} while starting: {tail(log)} (log: {log})")
            unhealthy: list[str] = []
            try:
                self.token = self.call("GET", "/auth/token")["access_token"]  # all admins: handed out
                unhealthy = self.unhealthy()
                if not unhealthy:
                    self.call("GET", f"/api/v2/dags/{self.wait_dag}")  # parsed: the stack is ready
                    return
            except (OSError, KeyError):
                pass
            if time.monotonic() > deadline:
                why = f"not healthy: {', '.join(unhealthy)}" if unhealthy else f"DAG {self.wait_dag} not served"
                raise StackError(f"Airflow was not ready within {self.start_timeout:.0f} s ({why}; "
                                 f"logs: {self.home}/{{{','.join(PARTS)}}}.log)")
            time.sleep(1)

    def __exit__(self, *exc: object) -> None:
        stop_parts(self.procs.values(), timeout=30)
        self.procs.clear()

    @classmethod
    def running(cls, base: str, home: Path, env: dict[str, str]) -> AirflowStack:
        """A client of a stack another process started and stops (a test run's shared one): its REST
        API, its home and environment; no parts of its own to stop."""
        stack = cls.__new__(cls)
        stack.base, stack.port, stack.home, stack.env = base, int(base.rsplit(":", 1)[1]), home, env
        stack.wait_dag, stack.start_timeout, stack.procs, stack.airflow = "", 0.0, {}, AIRFLOW
        stack.token = ""
        stack.token = stack.call("GET", "/auth/token")["access_token"]
        return stack

    def serve(self, dag_id: str, path: Path, timeout: float = 120) -> None:
        """Until the dag processor has parsed the new DAG file ``path`` and the API serves ``dag_id``; a
        file that fails to import is its import error, at once."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.call("GET", f"/api/v2/dags/{quote(dag_id)}")
                return
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
            errors = self.call("GET", "/api/v2/importErrors?limit=100").get("import_errors", [])
            mine = [e["stack_trace"] for e in errors if str(e.get("filename", "")).endswith(path.name)]
            if mine:
                raise StackError(f"{path} did not import: {mine[0].strip().splitlines()[-1]}")
            if time.monotonic() > deadline:
                raise StackError(f"DAG {dag_id} ({path}) not served within {timeout:.0f} s; "
                                 f"log: {self.home}/dag-processor.log")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in self.home.glob("*.log"))

    # -- the REST API --------------------------------------------------------------------------------
    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(self.base + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.token}"} if self.token else {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code >= 500:  # the API's 500 says nothing; its log says why
                e.add_note(f"{method} {path}: {_last_error(self.home / 'api-server.log')}")
            raise

    def unhealthy(self) -> list[str]:
        """The parts Airflow's health reports as not healthy (what its UI shows red)."""
        health = self.call("GET", "/api/v2/monitor/health")
        return [part for part, v in health.items() if (v or {}).get("status") != "healthy"]

    def trigger(self, dag_id: str) -> str:
        """Unpause the DAG (a home that `airflow dags test` used first has it paused) and start a run."""
        self.call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
        return str(self.call("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None})["dag_run_id"])

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        run: dict[str, Any] = self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}")
        return run

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        ti: dict[str, Any] = self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances/{task_id}")
        return ti

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """A try's log as the UI shows it (the REST API reads it from where the worker wrote it): each
        line's event, and under "Task failed with exception" the exception (``ExcType: message``)."""
        got = self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/logs/"
                               f"{try_number}?full_content=true")
        lines: list[str] = []
        for e in got.get("content") or []:
            if isinstance(e, dict):
                lines.append(str(e.get("event", "")))
                lines += [f"{x.get('exc_type')}: {x.get('exc_value')}" for x in e.get("error_detail") or []
                          if isinstance(x, dict)]
        return "\n".join(lines)

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str) -> Any:
        try:
            return self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/"
                                    f"xcomEntries/{key}")["value"]
        except urllib.error.HTTPError:
            return None

    def ti_url(self, dag_id: str, run_id: str, task_id: str, try_number: int | None = None) -> str:
        """The task instance's page in Airflow's UI (its Logs tab, at ``try_number``)."""
        url = f"{self.base}/dags/{dag_id}/runs/{quote(run_id, safe='')}/tasks/{task_id}"
        return url + (f"?try_number={try_number}" if try_number else "")

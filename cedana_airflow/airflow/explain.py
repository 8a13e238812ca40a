"""What `cedana-airflow explain --dags-folder` reads from a real DAG: the task's queue, pool, tags and the
arguments the opt-in rules judge, through Airflow's own DagBag."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from ..errors import ConfigError

__all__ = ["task_facts"]


def task_facts(dag_id: str, task_id: str, dags_folder: str | None) -> dict[str, Any]:
    from airflow.configuration import conf

    from ..airflow_compat import dag_bag

    folder = dags_folder or conf.get("core", "dags_folder")
    with contextlib.redirect_stdout(sys.stderr):  # Airflow logs the parse on stdout: `explain --json` owns it
        bag = dag_bag(dag_folder=folder)
    dag = bag.dags.get(dag_id)
    if dag is None:
        broken = [f"{path}: {err.splitlines()[-1] if err else '?'}" for path, err in bag.import_errors.items()]
        raise ConfigError(f"DAG {dag_id!r} is not in {folder}" + (f" (import errors: {'; '.join(broken)})" if broken else "")
                          + ". Check the DAG ID and --dags-folder.")
    if task_id not in dag.task_dict:
        raise ConfigError(f"DAG {dag_id} has no task {task_id!r}; its tasks: {', '.join(sorted(dag.task_dict))}.")
    task = dag.task_dict[task_id]
    expected = getattr(task, "expected_duration", None)
    return {"queue": task.queue, "pool": task.pool, "tags": tuple(dag.tags or ()),
            "expected_seconds": expected.total_seconds() if expected is not None else None,
            "job_server": bool(getattr(task, "job_server", False)), "gpu": bool(getattr(task, "gpu", False)),
            "checkpointed": bool(getattr(task, "cedana_checkpointed", False)),
            "mode": getattr(task, "mode", None) or (getattr(task, "settings", None) or {}).get("mode"),
            "heartbeat": _heartbeat_argument(task)}


def _heartbeat_argument(task: object) -> float | str | None:
    """The operator's ``heartbeat`` (a timedelta or "auto"), else its settings' heartbeat_seconds."""
    beat = getattr(task, "heartbeat", None)
    if beat is None:
        return (getattr(task, "settings", None) or {}).get("heartbeat_seconds")
    return beat if isinstance(beat, str) else float(beat.total_seconds())

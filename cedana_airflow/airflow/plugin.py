"""The Airflow plugin (entry point ``airflow.plugins``): what `airflow plugins` lists as ``cedana``.

- the macro that names a task's default checkpoint ID, so a DAG can pass the same ID to a
  CheckpointSensor: ``{{ macros.cedana.checkpoint_id(ti, run_id) }}``;
- the checkpoint browser (browser/) mounted at ``/cedana`` in the api-server, with a nav item
  (Browse > Checkpoints) and a tab on every task instance. Hrefs are built on ``[api] base_url``
  when it has a path, so a deployment under a prefix keeps working.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from ..ids import derive_checkpoint_id

__all__ = ["CedanaPlugin", "checkpoint_id"]


def checkpoint_id(ti: Any, run_id: str, task_id: str | None = None) -> str:
    """The default checkpoint ID of ``task_id`` (default: ``ti``'s own task) in this DAG run."""
    return derive_checkpoint_id(ti.dag_id, task_id or ti.task_id, run_id,
                                map_index=ti.map_index if task_id is None else -1)


def _href(path: str) -> str:
    """``path`` under ``[api] base_url``'s path (relative, as Airflow's UI resolves plugin hrefs)."""
    from urllib.parse import urlparse

    from airflow.configuration import conf

    prefix = urlparse(conf.get("api", "base_url", fallback="") or "").path.strip("/")
    return f"{prefix}/{path}" if prefix else path


def _fastapi_apps() -> list[dict[str, Any]]:
    from .browser import fastapi_app

    return [{"app": fastapi_app(), "url_prefix": "/cedana", "name": "cedana checkpoint browser"}]


class CedanaPlugin(AirflowPlugin):
    name = "cedana"
    macros = [checkpoint_id]
    fastapi_apps = _fastapi_apps()
    external_views = [
        {"name": "Checkpoints", "href": _href("cedana/"), "destination": "nav", "category": "browse",
         "url_route": "cedana-checkpoints"},
        {"name": "Checkpoints", "href": _href("cedana/ti?dag_id={DAG_ID}&run_id={RUN_ID}&task_id={TASK_ID}"
                                              "&map_index={MAP_INDEX}"),
         "destination": "task_instance", "url_route": "cedana-task-checkpoints"},
    ]

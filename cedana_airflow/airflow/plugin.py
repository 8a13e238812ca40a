"""The Airflow plugin (entry point ``airflow.plugins``): what `airflow plugins` lists as ``cedana``.

- the macro that names a task's default checkpoint ID, so a DAG can pass the same ID to a
  CheckpointSensor: ``{{ macros.cedana.checkpoint_id(ti, run_id) }}``;
- the checkpoint browser (browser/) mounted at ``/cedana`` in the api-server, with a nav item
  (Browse > Checkpoints) and a Checkpoints tab on task instances (``[cedana] task_instance_tab``: Airflow
  shows a plugin's tab on every task instance, it cannot limit one to some operators; our operators also
  carry a Checkpoints extra link, links.py). Hrefs are built on ``[api] base_url`` when it has a path, so
  a deployment under a prefix keeps working.

Every process that loads plugins imports this module, task processes included, so it imports almost
nothing: the browser's app, which pulls in Airflow's API server (over 700 modules, most of a second), is
built on its first request in the api-server (:class:`_LazyApp`; bench/plugin_import.py measures both).
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.plugins_manager import AirflowPlugin

from ..ids import derive_checkpoint_id

__all__ = ["CedanaPlugin", "checkpoint_id"]

log = logging.getLogger(__name__)


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


class _LazyApp:
    """The browser's ASGI app, imported and built on its first request. The api-server mounts it as it
    would the FastAPI app; every other process that loads the plugin never builds it."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:  # built without awaiting: no other request of this loop runs in between
            try:
                from .browser import fastapi_app

                self._app = fastapi_app()
            except Exception as e:  # was a plugin import error shown in the UI: now said here, and answered
                log.exception("cedana: the checkpoint browser could not be built")
                await _unavailable(send, f"cedana: the checkpoint browser could not be built: {type(e).__name__}: "
                                   f"{e} (the api-server's log has the traceback)")
                return
        await self._app(scope, receive, send)


async def _unavailable(send: Any, line: str) -> None:
    body = line.encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _task_instance_tab() -> bool:
    from airflow.configuration import conf

    try:
        return conf.getboolean("cedana", "task_instance_tab", fallback=True)
    except Exception as e:  # a bad value must not take the plugin (and its macro) down in every process
        log.warning("cedana: [cedana] task_instance_tab: %s; the tab is shown", e)
        return True


class CedanaPlugin(AirflowPlugin):
    name = "cedana"
    macros = [checkpoint_id]
    fastapi_apps = [{"app": _LazyApp(), "url_prefix": "/cedana", "name": "cedana checkpoint browser"}]
    external_views = [
        {"name": "Checkpoints", "href": _href("cedana/"), "destination": "nav", "category": "browse",
         "url_route": "cedana-checkpoints"},
        *([{"name": "Checkpoints", "href": _href("cedana/ti?dag_id={DAG_ID}&run_id={RUN_ID}&task_id={TASK_ID}"
                                                 "&map_index={MAP_INDEX}"),
            "destination": "task_instance", "url_route": "cedana-task-checkpoints"}] if _task_instance_tab() else []),
    ]

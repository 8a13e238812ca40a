"""The Checkpoints extra link of our operators: a button on their task instances (and only theirs) that
opens the task's checkpoints in the browser (``/cedana/ti``).

Airflow 3 computes a link when a try ends, in the task process, and keeps it as an XCom that its UI reads
(the api-server never imports this class), so the button appears on tries that ran. The link is a path
on the UI's own host: a worker's ``[api] base_url`` often names the api-server by an address only the
cluster reaches (the execution API's), so only its path, a deployment's prefix, is taken from it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode, urlparse

from airflow.sdk import BaseOperatorLink

__all__ = ["CheckpointsLink", "task_checkpoints_url"]


def task_checkpoints_url(dag_id: str, run_id: str, task_id: str, map_index: int, base_url: str = "") -> str:
    """The browser's page of one task instance, as a path on the UI's host, under ``base_url``'s path
    (``[api] base_url``) when it has one."""
    query = urlencode({"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index})
    prefix = urlparse(base_url).path.strip("/")
    return f"/{prefix + '/' if prefix else ''}cedana/ti?{query}"


class CheckpointsLink(BaseOperatorLink):
    name = "Checkpoints"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.configuration import conf

        return task_checkpoints_url(ti_key.dag_id, ti_key.run_id, ti_key.task_id,
                                    getattr(ti_key, "map_index", -1),
                                    conf.get("api", "base_url", fallback="") or "")

"""The Checkpoints extra link of our operators: a button on their task instances (and only theirs) that
opens the task's checkpoints in the browser (``/cedana/ti``).

Airflow 3 computes a link when a try ends, in the task process, and keeps it as an XCom that its UI reads
(the api-server never imports this class), so the button appears on tries that ran.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode, urljoin

from airflow.sdk import BaseOperatorLink

__all__ = ["CheckpointsLink", "task_checkpoints_url"]


def task_checkpoints_url(dag_id: str, run_id: str, task_id: str, map_index: int, base_url: str = "") -> str:
    """The browser's page of one task instance: under ``base_url`` (``[api] base_url``) when it is set,
    else a path on the api-server that serves the UI."""
    query = urlencode({"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index})
    return urljoin(base_url.rstrip("/") + "/" if base_url else "/", f"cedana/ti?{query}")


class CheckpointsLink(BaseOperatorLink):
    name = "Checkpoints"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.configuration import conf

        return task_checkpoints_url(ti_key.dag_id, ti_key.run_id, ti_key.task_id,
                                    getattr(ti_key, "map_index", -1),
                                    conf.get("api", "base_url", fallback="") or "")

"""The Airflow plugin (entry point ``airflow.plugins``): what `airflow plugins` lists as ``cedana``.

Today it carries the macro that names a task's default checkpoint ID, so a DAG can pass the same ID
to a CheckpointSensor: ``{{ macros.cedana.checkpoint_id(ti, run_id) }}``. Checkpoint browsing in the
UI joins it with its own issue.
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


class CedanaPlugin(AirflowPlugin):
    name = "cedana"
    macros = [checkpoint_id]

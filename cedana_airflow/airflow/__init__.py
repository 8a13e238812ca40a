"""The Airflow side of cedana-airflow: everything that imports Airflow, besides operators/ and sensors/.

Adapters only (DESIGN.md, layers): translate Airflow's configuration, connections and context into
core calls. ``config`` ([cedana] and the task's settings), ``store`` (an S3 client from a connection),
``task_state`` (tries and nodes, kept across retries), ``logsink`` (workload output into the task log),
``plugin`` and ``policy`` (the entry points), ``kube`` (the Kubernetes route), ``decorators``
(``@task.checkpointed``), ``explain`` (a task's facts from a DAG folder). The operators and sensors
live in the top-level ``operators/`` and ``sensors/`` folders and ship as ``cedana_airflow.operators``
and ``cedana_airflow.sensors``.
"""

from __future__ import annotations

from typing import Any

from .. import __version__

__all__ = ["get_provider_info"]


def get_provider_info() -> dict[str, Any]:
    """What ``airflow providers list`` shows; the ``apache_airflow_provider`` entry point returns it.

    The [cedana] options come from the settings models (``config.config_options``), imported here
    rather than at module level: provider discovery imports this package before Airflow's config is ready.
    """
    from .config import config_options

    return {
        "package-name": "cedana-airflow",
        "name": "Cedana checkpointing",
        "description": "Transparent GPU/CPU checkpointing of Airflow tasks with CRIU; restores a retried or cleared task from its latest checkpoint.",
        "versions": [__version__],
        "task-decorators": [{"name": "checkpointed", "class-name": "cedana_airflow.airflow.decorators.checkpointed_task"}],
        "config": {
            "cedana": {
                "description": "cedana-airflow: where checkpoints go and how often they are taken. Also AIRFLOW__CEDANA__<OPTION>.",
                "options": {
                    o.name: {"description": o.description, "version_added": None, "type": o.type, "example": None,
                             "default": o.default}
                    for o in config_options()
                },
            }
        },
    }

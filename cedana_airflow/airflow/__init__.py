"""The Airflow side of cedana-airflow, besides the provider's operators, sensors, hooks and triggers.

Adapters only (DESIGN.md, layers): translate Airflow's configuration, connections and context into
core calls. ``task`` (the task adapter every operator uses: settings, the opt-in decision, the
checkpoint ID, errors mapped to Airflow's), ``config`` ([cedana] and the task's settings),
``task_state`` (tries and nodes, kept across retries), ``logsink`` (workload output into the task log),
``plugin`` and ``policy`` (the entry points), ``browser`` (the checkpoint pages), ``kube`` (the
Kubernetes route's pod spec), ``decorators`` (``@task.checkpointed``), ``drills`` and ``live_fleet``
(the drill DAG's side), ``explain`` (a task's facts from a DAG folder). The operators and sensors live
in the top-level ``operators/`` and ``sensors/`` folders and ship as ``cedana_airflow.operators`` and
``cedana_airflow.sensors``; hooks and triggers are ``cedana_airflow.hooks`` and ``cedana_airflow.triggers``.
"""

from __future__ import annotations

import importlib.util
import pkgutil
from typing import Any

from .. import __version__

__all__ = ["get_provider_info"]

INTEGRATION = "Cedana checkpointing"


def _modules(package: str) -> list[str]:
    """The modules of ``package``, found on disk without importing it (a new module is declared by itself)."""
    spec = importlib.util.find_spec(package)
    paths = list(spec.submodule_search_locations or []) if spec else []
    return sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules(paths) if not m.name.startswith("_"))


def get_provider_info() -> dict[str, Any]:
    """What ``airflow providers list`` shows; the ``apache_airflow_provider`` entry point returns it.

    The [cedana] options come from the settings models (``config.config_options``), imported here
    rather than at module level: provider discovery imports this package before Airflow's config is ready.
    """
    from .config import config_options
    from .option_versions import VERSION_ADDED

    return {
        "package-name": "cedana-airflow",
        "name": "Cedana checkpointing",
        "description": "Transparent GPU/CPU checkpointing of Airflow tasks with CRIU; restores a retried or cleared task from its latest checkpoint.",
        "versions": [__version__],
        "integrations": [{"integration-name": INTEGRATION, "tags": ["software"]}],
        **{kind: [{"integration-name": INTEGRATION, "python-modules": _modules(f"cedana_airflow.{kind}")}]
           for kind in ("operators", "sensors")},
        # hooks/ holds helpers, not BaseHook classes: nothing to declare. CheckpointSensor's trigger lives
        # beside its sensor, so its module is named as well as triggers/'.
        "triggers": [{"integration-name": INTEGRATION,
                      "python-modules": [*_modules("cedana_airflow.triggers"), "cedana_airflow.sensors.checkpoint"]}],
        "extra-links": ["cedana_airflow.airflow.links.CheckpointsLink"],
        "task-decorators": [{"name": "checkpointed", "class-name": "cedana_airflow.airflow.decorators.checkpointed_task"}],
        "config": {
            "cedana": {
                "description": "cedana-airflow: where checkpoints go and how often they are taken. Also AIRFLOW__CEDANA__<OPTION>.",
                "options": {
                    # A core option declares no default (config.py says why) but shows it as its example.
                    # The inline node key is masked by Airflow's config API and UI, and may come from _SECRET/_CMD.
                    o.name: {"description": o.description, "version_added": VERSION_ADDED[o.name], "type": o.type,
                             "example": o.example, "default": o.default,
                             **({"sensitive": True} if o.name == "signing_key" else {})}
                    for o in config_options()
                },
            }
        },
    }

"""A stand-in for an auth manager with per-DAG roles (FAB's), which this machine does not install:
Airflow's SimpleAuthManager, where a user named ``<name>@<dag>+<dag>`` may read only those DAGs.

Only ``is_authorized_dag`` changes; tokens, cookies, login and roles are SimpleAuthManager's own.
"""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager


class DagScopedAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        allowed = user.username.partition("@")[2]
        if allowed and (details is None or details.id not in allowed.split("+")):
            return False  # a scoped user never has "every DAG", nor another DAG
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)

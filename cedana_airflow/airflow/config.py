"""Settings inside Airflow: the core Settings, with airflow.cfg's [cedana] (AIRFLOW__CEDANA__*) on top.

Precedence, rising: core defaults < CEDANA_CONFIG < CEDANA_* < [cedana] < operator arguments. A bad
value is one ConfigError naming the option and where it came from, raised when the operator is
built (so the DAG shows an import error) or when the task starts, never deep inside a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..config import Settings, load_settings
from ..errors import ConfigError

__all__ = ["TaskOptions", "task_settings"]

#: [cedana] options that are not core settings.
_AIRFLOW_ONLY = {"aws_conn_id", "same_node_retry", "k8s_route", "k8s_runtime_class"}


@dataclass(frozen=True)
class TaskOptions:
    aws_conn_id: str | None
    same_node_retry: Literal["allow", "fail"]


def _section() -> dict[str, str]:
    from airflow.configuration import conf

    from . import CONFIG_OPTIONS

    out = {}
    for name, *_ in CONFIG_OPTIONS:
        value = conf.get("cedana", name, fallback=None)
        if value not in (None, ""):
            out[name] = value
    return out


def _default_store() -> str:
    from airflow.configuration import AIRFLOW_HOME

    return f"file://{Path(AIRFLOW_HOME) / 'cedana' / 'store'}"


def task_settings(overrides: Mapping[str, Any] | None = None,
                  scope_defaults: Mapping[str, Any] | None = None) -> tuple[Settings, TaskOptions]:
    """``scope_defaults``: what the opt-in list sets for the scopes that admitted the task (above
    [cedana], below operator arguments)."""
    section = _section()
    core = {k: v for k, v in section.items() if k not in _AIRFLOW_ONLY}
    layers = [(lambda k: f"airflow.cfg [cedana] {k} / AIRFLOW__CEDANA__{k.upper()}", core),
              (lambda k: f"the opt-in list's defaults ({k})", dict(scope_defaults or {}))]
    settings = load_settings({k: v for k, v in (overrides or {}).items() if k not in _AIRFLOW_ONLY},
                             layers=layers, overrides_source=lambda k: f"operator argument {k}")
    if not settings.store:
        settings = settings.model_copy(update={"store": _default_store()})
    policy = section.get("same_node_retry", "allow")
    if policy not in ("allow", "fail"):
        raise ConfigError(f"setting same_node_retry = {policy!r} (from airflow.cfg [cedana] same_node_retry / "
                          "AIRFLOW__CEDANA__SAME_NODE_RETRY) is invalid: use 'allow' or 'fail'.")
    conn = (overrides or {}).get("aws_conn_id") or section.get("aws_conn_id")
    return settings, TaskOptions(aws_conn_id=conn, same_node_retry=policy)  # type: ignore[arg-type]

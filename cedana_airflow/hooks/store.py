"""A task's store: the store URL from settings, for s3:// an S3 client built from an Airflow connection.
(The key that signs its manifests is the node's own, never Airflow's: keys.py.)"""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import ConfigError
from ..store import Store, open_store
from ..store.s3 import client_config

__all__ = ["named_connection", "task_store", "s3_client_for"]


def s3_client_for(aws_conn_id: str, settings: Settings) -> Any:
    """The amazon provider's S3Hook client for ``aws_conn_id`` (its credentials, region and endpoint_url)."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    # Looked up first: S3Hook on its own logs a warning for a missing connection and carries on with
    # boto3's default chain, which could write checkpoints somewhere nobody configured.
    named_connection(aws_conn_id, "aws_conn_id", "to use boto3's credential chain")
    return S3Hook(aws_conn_id=aws_conn_id, config=client_config(settings)).get_conn()


def named_connection(conn_id: str, option: str, without: str) -> Any:
    """The Airflow connection an option names; a missing one is one line naming the option and the fix."""
    from airflow.sdk import BaseHook

    from ..airflow_compat import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        raise ConfigError(
            f"Airflow connection {conn_id!r} ({option}) is not defined. Create it (Admin > Connections, "
            f"'airflow connections add', or AIRFLOW_CONN_{conn_id.upper()}) or drop {option} {without}."
        ) from None


def task_store(settings: Settings, aws_conn_id: str | None) -> Store:
    url = settings.resolved_store()
    if url.startswith("s3://") and aws_conn_id:
        return open_store(url, settings, s3_client=s3_client_for(aws_conn_id, settings))
    return open_store(url, settings)

"""A task's store: the URL from settings, and for s3:// an S3 client built from an Airflow connection."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import ConfigError
from ..store import Store, open_store
from ..store.s3 import client_config

__all__ = ["task_store", "s3_client_for"]


def s3_client_for(aws_conn_id: str, settings: Settings) -> Any:
    """The amazon provider's S3Hook client for ``aws_conn_id`` (its credentials, region and endpoint_url)."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    # Looked up first: S3Hook on its own logs a warning for a missing connection and carries on with
    # boto3's default chain, which could write checkpoints somewhere nobody configured.
    try:
        BaseHook.get_connection(aws_conn_id)
    except AirflowNotFoundException:
        raise ConfigError(
            f"Airflow connection {aws_conn_id!r} (aws_conn_id) is not defined. Create it (Admin > Connections, "
            f"'airflow connections add', or AIRFLOW_CONN_{aws_conn_id.upper()}) or drop aws_conn_id to use "
            "boto3's credential chain."
        ) from None
    return S3Hook(aws_conn_id=aws_conn_id, config=client_config(settings)).get_conn()


def task_store(settings: Settings, aws_conn_id: str | None) -> Store:
    url = settings.resolved_store()
    if url.startswith("s3://") and aws_conn_id:
        return open_store(url, settings, s3_client=s3_client_for(aws_conn_id, settings))
    return open_store(url, settings)

"""Airflow operators of cedana-airflow (shipped as ``cedana_airflow.operators``)."""

from .checkpointed import CheckpointedCommandOperator

__all__ = ["CheckpointedCommandOperator"]

"""Airflow operators of cedana-airflow (shipped as ``cedana_airflow.operators``)."""

from .checkpointed import CheckpointedCommandOperator

__all__ = ["CheckpointedCommandOperator", "CedanaKubernetesPodOperator"]


def __getattr__(name: str) -> object:
    # The Kubernetes operator imports the kubernetes client: only when asked for.
    if name == "CedanaKubernetesPodOperator":
        from .kubernetes import CedanaKubernetesPodOperator

        return CedanaKubernetesPodOperator
    raise AttributeError(name)

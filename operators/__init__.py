"""Airflow operators of cedana-airflow (shipped as ``cedana_airflow.operators``)."""

from .checkpointed import CheckpointedCommandOperator

__all__ = ["CheckpointedCommandOperator", "CedanaKubernetesJobOperator", "CedanaKubernetesPodOperator", "CedanaSlurmOperator"]


def __getattr__(name: str) -> object:
    # The Kubernetes operator imports the kubernetes client: only when asked for.
    if name in ("CedanaKubernetesPodOperator", "CedanaKubernetesJobOperator"):
        from . import kubernetes

        return getattr(kubernetes, name)
    if name == "CedanaSlurmOperator":
        from .slurm import CedanaSlurmOperator

        return CedanaSlurmOperator
    raise AttributeError(name)

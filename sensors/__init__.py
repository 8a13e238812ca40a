"""Airflow sensors of cedana-airflow (shipped as ``cedana_airflow.sensors``)."""

from .checkpoint import CheckpointSensor, CheckpointTrigger
from .gpu import GpuSensor

__all__ = ["CheckpointSensor", "CheckpointTrigger", "GpuSensor", "NodeReadySensor"]


def __getattr__(name: str) -> object:
    # NodeReadySensor imports the kubernetes client: only when asked for.
    if name == "NodeReadySensor":
        from .node_ready import NodeReadySensor

        return NodeReadySensor
    raise AttributeError(name)

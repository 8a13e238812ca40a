"""Airflow sensors of cedana-airflow (shipped as ``cedana_airflow.sensors``)."""

from .checkpoint import CheckpointSensor, CheckpointTrigger
from .gpu import GpuSensor

__all__ = ["CheckpointSensor", "CheckpointTrigger", "GpuSensor"]

"""GpuSensor: wait until this worker's GPUs have room (free memory, utilization) and report no Xid errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator

from cedana_airflow.airflow_compat import AirflowFailException, AirflowSkipException
from cedana_airflow.engine.cuda import load_driver
from cedana_airflow.errors import GpuUnavailable
from cedana_airflow.node.gpu import read_gpus, unmet_conditions

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["GpuSensor"]


class GpuSensor(BaseSensorOperator):
    """Poke NVML on the worker that runs this sensor (place it on the GPU queue of the job it guards).

    :param min_free_memory_bytes: every listed GPU has at least this much memory free.
    :param max_utilization_percent: every listed GPU is at most this busy.
    :param gpu_indices: which GPUs (default: all of them).
    :param xid_listen_seconds: how long each poke listens for Xid errors (NVML only reports an Xid to
        a listener registered when it happens). An Xid fails the sensor: the node needs attention,
        and waiting will not fix it.
    :param require_checkpoint_api: also require that this node can checkpoint GPU state (the driver's
        checkpoint API, the same detection as ``gpu = require`` and the opt-in rule ``gpu_needs_nvidia``).
    With no NVIDIA driver on the worker (or, with ``require_checkpoint_api``, no checkpoint API) the
    sensor fails with one line, or skips when ``soft_fail``.
    """

    template_fields: Sequence[str] = ("gpu_indices",)

    def __init__(self, *, min_free_memory_bytes: int | None = None, max_utilization_percent: int | None = None,
                 gpu_indices: list[int] | None = None, xid_listen_seconds: float = 1.0,
                 require_checkpoint_api: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.require_checkpoint_api = require_checkpoint_api
        self.min_free_memory_bytes = min_free_memory_bytes
        self.max_utilization_percent = max_utilization_percent
        self.gpu_indices = gpu_indices
        self.xid_listen_seconds = xid_listen_seconds

    def poke(self, context: Context) -> bool:
        try:
            if self.require_checkpoint_api:
                load_driver()
            report = read_gpus(self.gpu_indices, self.xid_listen_seconds)
        except GpuUnavailable as e:
            if self.soft_fail:
                raise AirflowSkipException(f"cedana: {e}") from None
            raise AirflowFailException(f"cedana: {e}") from None
        if report.xids:
            raise AirflowFailException("cedana: " + "; ".join(f"GPU {i} reported Xid {x}" for i, x in report.xids)
                                       + ". Drain this node and check `nvidia-smi -q` and the kernel log.")
        why = unmet_conditions(report, min_free_bytes=self.min_free_memory_bytes,
                               max_utilization_percent=self.max_utilization_percent, no_xid=False)
        for line in why:
            self.log.info("cedana: waiting: %s", line)
        return not why

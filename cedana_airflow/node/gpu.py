"""GPU state through NVML (pynvml): free memory, utilization, and Xid errors, for sensors and policies.

NVML reports an Xid only to a listener registered when it happens, so :func:`read_gpus` listens for
``xid_listen_seconds``; an Xid from before the call is not seen (the kernel log has those, root only).
"""

from __future__ import annotations

import ctypes
import socket
from dataclasses import dataclass, field
from typing import Any

from ..errors import GpuUnavailable

__all__ = ["GpuState", "GpuReport", "read_gpus", "unmet_conditions"]


@dataclass(frozen=True)
class GpuState:
    index: int
    name: str
    memory_total: int
    memory_free: int
    utilization_percent: int


@dataclass(frozen=True)
class GpuReport:
    gpus: tuple[GpuState, ...]
    xids: tuple[tuple[int, int], ...] = field(default=())  # (device index, Xid) seen while listening


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise GpuUnavailable("pynvml is not installed. Install it with pip install 'cedana-airflow[gpu]'.") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise GpuUnavailable(
            f"no NVIDIA driver on node {socket.gethostname()} (NVML: {e}). Run this on a GPU worker "
            "(an opted-in GPU queue or node), or let the task soft-fail."
        ) from None
    return pynvml


def read_gpus(indices: list[int] | None = None, xid_listen_seconds: float = 0.0) -> GpuReport:
    nv = _nvml()
    try:
        count = nv.nvmlDeviceGetCount()
        wanted = list(range(count)) if indices is None else indices
        for i in wanted:
            if not 0 <= i < count:
                raise GpuUnavailable(f"GPU index {i} does not exist on {socket.gethostname()} ({count} GPU(s)).")
        states, handles = [], {}
        for i in wanted:
            h = handles[i] = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            name = nv.nvmlDeviceGetName(h)
            states.append(GpuState(i, name.decode() if isinstance(name, bytes) else str(name), int(mem.total),
                                   int(mem.free), int(util.gpu)))
        xids: list[tuple[int, int]] = []
        if xid_listen_seconds > 0:
            xids = _listen_for_xids(nv, handles, xid_listen_seconds)
        return GpuReport(tuple(states), tuple(xids))
    finally:
        nv.nvmlShutdown()


def _address(handle: Any) -> int | None:
    """The device a pynvml handle (a ctypes pointer) points to."""
    return ctypes.cast(handle, ctypes.c_void_p).value


def _listen_for_xids(nv: Any, handles: dict[int, Any], seconds: float) -> list[tuple[int, int]]:
    events = nv.nvmlEventSetCreate()
    try:
        for h in handles.values():
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
            except nv.NVMLError:
                pass  # some GPUs (and MIG instances) do not report Xids to listeners
        out: list[tuple[int, int]] = []
        timeout_ms = int(seconds * 1000)
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(events, timeout_ms)
            except nv.NVMLError_Timeout:
                return out
            # an event's device is a new ctypes pointer object: compare what it points to, not identity
            index = next((i for i, h in handles.items() if _address(h) == _address(data.device)), -1)
            out.append((index, int(data.eventData)))
            timeout_ms = 0  # drain what is queued, then stop
    finally:
        nv.nvmlEventSetFree(events)


def unmet_conditions(report: GpuReport, *, min_free_bytes: int | None = None, max_utilization_percent: int | None = None,
                     no_xid: bool = True) -> list[str]:
    """Why the GPUs are not ready yet (empty when every condition holds on every listed GPU)."""
    why = []
    for g in report.gpus:
        if min_free_bytes is not None and g.memory_free < min_free_bytes:
            why.append(f"GPU {g.index} ({g.name}) has {g.memory_free} bytes free, below {min_free_bytes}")
        if max_utilization_percent is not None and g.utilization_percent > max_utilization_percent:
            why.append(f"GPU {g.index} ({g.name}) is {g.utilization_percent}% busy, above {max_utilization_percent}%")
    if no_xid:
        why += [f"GPU {i} reported Xid {x}" for i, x in report.xids]
    return why

"""GPU state in a managed run: when a tree holding CUDA state may be checkpointed or restored here.

The ``gpu`` setting decides (docs/gpu.md):

- ``auto``: a tree with CUDA state (the driver says which processes have it) is checkpointed through
  the driver's checkpoint API (engine/cuda.py) when this node has it; where it does not, a tree that
  holds ``/dev/nvidia*`` has its heartbeats skipped, said once, and the workload keeps running.
- ``require``: the run refuses to start where GPU state cannot be checkpointed (exit 2).
- ``off``: the GPU is never touched; a tree holding CUDA state is not checkpointed, said once.

A checkpoint holding GPU state is restored only where the driver has the API and the node's GPU
models are the ones it was taken on, in the same order (the driver restores by device index);
otherwise it is refused like a corrupt one.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator, Sequence

from ..config import Settings
from ..engine import cuda
from ..engine.procfs import tree_pids
from ..errors import ConfigError, GpuCheckpointFailed, GpuUnavailable, RestoreFailed
from ..format.manifest import GpuProcess, GpuState, Manifest
from .estimate import Estimate
from .workload import Workload

__all__ = ["GpuGate"]

log = logging.getLogger(__name__)


class GpuGate:
    """The ``gpu`` setting applied to one run. ``load`` gives the driver (a stand-in in tests)."""

    def __init__(self, settings: Settings, load: Callable[[], cuda.CudaDriver] = cuda.load_driver,
                 inventory: Callable[[], cuda.GpuInventory] = cuda.gpu_inventory) -> None:
        self.mode = settings.gpu
        self.lock_timeout_ms = cuda.lock_timeout_ms(settings.gpu_lock_timeout_seconds)
        self._load, self._inventory = load, inventory
        self._said: set[str] = set()
        self._unavailable: str | None = None  # why the driver cannot be used here, once known

    def _driver(self) -> cuda.CudaDriver | None:
        """The driver, or None (the reason in ``_unavailable``) on a node that cannot checkpoint GPU
        state; asked once per run, not at every heartbeat."""
        if self._unavailable is not None:
            return None
        try:
            return self._load()
        except GpuUnavailable as e:
            self._unavailable = str(e)
            return None

    def require(self) -> None:
        """``gpu = require``: a node that cannot checkpoint GPU state is a configuration error (exit 2)."""
        if self.mode != "require":
            return
        try:
            self._load()
        except GpuUnavailable as e:
            raise ConfigError(f"gpu = require, but this node cannot checkpoint GPU state: {e}") from None

    # -- checkpoint ---------------------------------------------------------------------------
    def dump_refusal(self, pids: Sequence[int]) -> tuple[list[int], str | None]:
        """The tree's CUDA processes (the driver's answer), and why it must not be dumped now (None: go ahead)."""
        holders = cuda.device_holders(pids)  # what CRIU cannot dump, whatever the driver says
        driver = None if self.mode == "off" else self._driver()  # off: the GPU is never touched
        if driver is None:
            if not holders:
                return [], None
            what = f"the tree holds GPU devices (pid {holders[0]}: {', '.join(cuda.nvidia_files(holders[0]))})"
            if self.mode == "off":
                return holders, f"{what} and gpu = off, so it is not checkpointed"
            return holders, f"{what}, but {self._unavailable}"
        try:  # also finds a process already locked or checkpointed, which holds no device file
            found = cuda.cuda_processes(driver, pids, holders)
        except GpuCheckpointFailed as e:
            return [], f"the driver could not say which processes hold CUDA state ({e})"
        strays = [p for p in holders if p not in found]
        if strays:
            return list(found), (f"pid {strays[0]} holds {', '.join(cuda.nvidia_files(strays[0]))} but has no CUDA state "
                                 "the driver can checkpoint (it reaches the GPU through NVML only, or it was forked from "
                                 "a CUDA process without exec), and CRIU cannot dump a device file")
        return list(found), None

    def say_once(self, why: str) -> None:
        (log.debug if why in self._said else log.warning)("%s", why)
        self._said.add(why)

    @contextlib.contextmanager
    def suspended(self, holding: Sequence[int], *, leave_running: bool) -> Iterator[cuda.GpuSuspension | None]:
        if not holding:
            yield None
            return
        with cuda.suspended(self._load(), holding, lock_timeout_ms=self.lock_timeout_ms, resume=leave_running) as s:
            yield s

    def state(self, s: cuda.GpuSuspension, estimate: Estimate) -> GpuState:
        inv, used = self._inventory(), dict(estimate.gpu_by_pid)
        return GpuState(driver_version=inv.driver_version, cuda_api_version=self._load().version(), gpus=inv.models,
                        processes=tuple(GpuProcess(ns_pid=cuda.ns_pid(p), memory_bytes=used.get(p, 0)) for p in s.pids),
                        checkpoint_seconds=round(s.checkpoint_seconds, 6), resume_seconds=round(s.resume_seconds, 6))

    # -- restore ------------------------------------------------------------------------------
    def restore_refusal(self, m: Manifest) -> str | None:
        if m.gpu is None:
            return None
        held = f"seq {m.seq} holds GPU state (GPUs {_models(m.gpu.gpus)})"
        if self.mode == "off":
            return f"{held} and gpu = off on this node"
        try:
            self._load()
        except GpuUnavailable as e:
            return f"{held}, but {e}"
        here = self._inventory().models
        if tuple(here) != tuple(m.gpu.gpus):  # by index: GPU 0's memory goes back to GPU 0
            return (f"{held}; this node has GPUs {_models(here)}: the driver restores GPU state only onto the same "
                    "GPU models in the same order (device index)")
        return None

    def resume(self, workload: Workload, m: Manifest) -> float:
        """After ``criu restore``: copy each process's GPU state back and unlock it. On failure the
        restored tree is killed (never left half-restored) and the checkpoint is refused."""
        if m.gpu is None:
            return 0.0
        by_ns = {cuda.ns_pid(p): p for p in tree_pids(workload.pid)}
        try:
            missing = [g.ns_pid for g in m.gpu.processes if g.ns_pid not in by_ns]
            if missing:
                raise GpuCheckpointFailed(f"the restored tree has no process {missing[0]} (in its namespace)")
            return cuda.resume_restored(self._load(), [by_ns[g.ns_pid] for g in m.gpu.processes])
        except (GpuCheckpointFailed, GpuUnavailable) as e:
            workload.stop(0, signal.SIGKILL)
            raise RestoreFailed(f"checkpoint {m.checkpoint_id} seq={m.seq}: GPU state could not be put back ({e}); "
                                "the restored tree was killed") from None


def _models(models: Sequence[str]) -> str:
    """GPU models by device index: "0: NVIDIA H200, 1: NVIDIA H100", or "none"."""
    return ", ".join(f"{i}: {name}" for i, name in enumerate(models)) or "none"

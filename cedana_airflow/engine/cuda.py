"""CUDA state through the driver's checkpoint API: what lets CRIU dump a process that holds GPU memory.

CRIU cannot dump ``/dev/nvidia*`` mappings. NVIDIA's driver (the ``cuCheckpointProcess*`` calls of
libcuda, CUDA 12.8 / driver 570 and later) can move one process's CUDA state into its host memory
and back, driven from another process by pid: lock (its CUDA calls block), checkpoint (GPU memory
copied out, every device mapping released), then, after CRIU, restore (memory back at the same
device addresses) and unlock. docs/gpu.md has the sources and the limits.

Which processes hold CUDA state is the driver's answer (``cuCheckpointProcessGetState``), not a guess
from open ``/dev/nvidia*`` files: a process already locked or checkpointed holds none, and one that
holds them only through NVML, or a child forked from a CUDA process, has no CUDA state to lock.

:func:`suspended` is that sequence around a dump. Whatever fails, every process is brought back to
running from the state the driver reports for it, never from a guess about how far the sequence got.

The binding is ctypes over ``libcuda.so.1``: no package to install, and no import of it on a node
without a GPU. :class:`CudaDriver` is the protocol, so tests drive the state machine with a stand-in.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import GpuCheckpointFailed, GpuUnavailable

__all__ = ["NO_CUDA", "CudaDriver", "GpuInventory", "GpuSuspension", "LibcudaDriver", "bring_back", "cuda_processes",
           "device_holders", "gpu_inventory", "libcuda_loadable", "load_driver", "lock_timeout_ms", "ns_pid",
           "nvidia_files", "resume_restored", "suspended"]

log = logging.getLogger(__name__)

#: The driver API version (cuDriverGetVersion: 1000 * major + 10 * minor) that has the checkpoint API.
MIN_API_VERSION = 12080
_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
#: cuCheckpointProcessGetState's errors for a pid without CUDA state. NVIDIA documents no code for that
#: case; CRIU's driver-API CUDA plugin (PR #3076) and NVIDIA Dynamo's snapshot agent read these two so,
#: and treat any other error as a failure. docs/gpu.md.
NO_CUDA_ERRORS = {1: "CUDA_ERROR_INVALID_VALUE", 3: "CUDA_ERROR_NOT_INITIALIZED"}
#: What state() says of a pid the driver holds no CUDA state for.
NO_CUDA = "none"


class CudaDriver(Protocol):
    def version(self) -> int: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int) -> None: ...
    def unlock(self, pid: int) -> None: ...

    def state(self, pid: int) -> str:
        """"running", "locked", "checkpointed", "failed", "unknown (N)", or NO_CUDA; GpuCheckpointFailed
        when the driver cannot answer."""
        ...


class _LockArgs(ctypes.Structure):
    # CUcheckpointLockArgs (cuda.h): 64 bytes; every reserved field must be zero.
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class LibcudaDriver:
    """The checkpoint API of the installed driver, through ctypes. Every failure raises one line."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._version = 0

    def _call(self, what: str, pid: int, rc: int) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            raise GpuCheckpointFailed(f"{what} of pid {pid} failed: {(name.value or b'CUDA error').decode()} ({rc})")

    def version(self) -> int:
        if not self._version:
            v = ctypes.c_int()
            self._lib.cuDriverGetVersion(ctypes.byref(v))
            self._version = v.value
        return self._version

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = _LockArgs(timeoutMs=max(1, timeout_ms))  # 0 would be "no timeout" to the driver
        self._call("cuCheckpointProcessLock", pid, self._lib.cuCheckpointProcessLock(pid, ctypes.byref(args)))

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, self._lib.cuCheckpointProcessCheckpoint(pid, None))

    def restore(self, pid: int) -> None:
        self._call("cuCheckpointProcessRestore", pid, self._lib.cuCheckpointProcessRestore(pid, None))

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, self._lib.cuCheckpointProcessUnlock(pid, None))

    def state(self, pid: int) -> str:
        s = ctypes.c_int()
        rc = self._lib.cuCheckpointProcessGetState(pid, ctypes.byref(s))
        if rc in NO_CUDA_ERRORS:
            return NO_CUDA
        self._call("cuCheckpointProcessGetState", pid, rc)
        return _STATES.get(s.value, f"unknown ({s.value})")  # CUDA 13.4 adds 4 and 5 (checkpointing, restoring)


def lock_timeout_ms(seconds: float) -> int:
    """The lock's timeoutMs for ``seconds``: at least 1, since the driver reads 0 as "no timeout" (a
    workload whose CUDA work never finishes would hold the heartbeat, and the stop, forever)."""
    return max(1, round(seconds * 1000))


_driver: LibcudaDriver | None = None


def libcuda_loadable() -> bool:
    """Whether the driver's library is here at all (``load_driver`` also needs its checkpoint API)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def load_driver() -> LibcudaDriver:
    """The node's driver, loaded once; GpuUnavailable (one line: what is missing) when it cannot
    checkpoint GPU state: no libcuda, a driver without the checkpoint API, or cuInit failing."""
    global _driver
    if _driver is not None:
        return _driver
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise GpuUnavailable(f"no NVIDIA driver on this node ({e}). Checkpointing GPU state needs driver 570 or "
                             "later: run GPU tasks on GPU nodes, or set gpu = off") from None
    drv = LibcudaDriver(lib)
    if not hasattr(lib, "cuCheckpointProcessLock") or drv.version() < MIN_API_VERSION:
        raise GpuUnavailable(f"the NVIDIA driver here (CUDA API {drv.version()}) has no checkpoint API "
                             "(cuCheckpointProcess*, CUDA 12.8 / driver 570 and later). Upgrade the driver, or set gpu = off")
    rc = lib.cuInit(0)
    if rc != 0:
        raise GpuUnavailable(f"the NVIDIA driver is installed but cuInit failed ({rc}): no usable GPU here "
                             "(check nvidia-smi and the device permissions), or set gpu = off")
    _driver = drv
    return drv


@dataclass(frozen=True)
class GpuInventory:
    """What the kernel module says about this node: no library, no NVML needed."""

    driver_version: str  # "" without the kernel module
    models: tuple[str, ...]  # in PCI bus order, which is NVML's index order


_MODULE_VERSION = re.compile(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s")


def gpu_inventory(root: Path = Path("/proc/driver/nvidia")) -> GpuInventory:
    try:
        m = _MODULE_VERSION.search((root / "version").read_text())
    except OSError:
        return GpuInventory("", ())
    models = []
    for info in sorted((root / "gpus").glob("*/information")):
        with contextlib.suppress(OSError):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    models.append(line.split(":", 1)[1].strip())
    return GpuInventory(m.group(1) if m else "?", tuple(models))


# -- which processes hold CUDA state --------------------------------------------------------------
def nvidia_files(pid: int) -> list[str]:
    """The ``/dev/nvidia*`` files a process maps or holds open (what CRIU cannot dump)."""
    found: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/nvidia"):
                    found.add(path[0])
    except (OSError, IndexError):
        pass
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/nvidia"):
                    found.add(target)
    return sorted(found)


def device_holders(pids: Sequence[int]) -> list[int]:
    """Those of ``pids`` that hold ``/dev/nvidia*`` open or mapped: what a node without the driver's
    checkpoint API can still see (and must not hand to CRIU)."""
    return [p for p in pids if nvidia_files(p)]


def cuda_processes(driver: CudaDriver, pids: Sequence[int], holders: Sequence[int] = ()) -> dict[int, str]:
    """Those of ``pids`` the driver holds CUDA state for, with that state, in ``pids``' order.

    A driver error for a process that holds no ``/dev/nvidia*`` file (not in ``holders``) reads as no
    CUDA state: the "no CUDA" codes are nobody's documented contract, and a driver that answered
    another one must not stop the checkpoints of every CPU task on a GPU node. (A process the driver
    has checkpointed holds no device file, but the driver answers for it.) For a holder, the error
    goes up (GpuCheckpointFailed)."""
    out = {}
    for pid in pids:
        try:
            state = driver.state(pid)
        except GpuCheckpointFailed as e:
            if pid in holders:
                raise
            log.debug("no CUDA state for pid %d (it holds no device file): %s", pid, e)
            continue
        if state != NO_CUDA:
            out[pid] = state
    return out


def ns_pid(pid: int) -> int:
    """A process's pid inside its innermost PID namespace (the one a restore brings back), from NSpid."""
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    return pid


# -- the sequence ---------------------------------------------------------------------------------
@dataclass
class GpuSuspension:
    """What :func:`suspended` did: which processes, and how long the copy-out and the copy-back took."""

    pids: tuple[int, ...]
    checkpoint_seconds: float = 0.0
    resume_seconds: float = 0.0


def bring_back(driver: CudaDriver, pids: Sequence[int]) -> list[str]:
    """Every one of ``pids`` back to running, from the state the driver reports for each: every
    checkpointed one restored before any is unlocked (as every one is locked before any is copied
    out), newest first; the problems, if any. Never raises."""
    problems: dict[int, str] = {}

    def step(action: str) -> None:
        for pid in reversed(pids):
            if pid in problems:
                continue
            try:
                state = driver.state(pid)
                if action == "restore" and state == "checkpointed":
                    driver.restore(pid)
                elif action == "unlock" and state == "locked":
                    driver.unlock(pid)
                elif action == "check" and state != "running":
                    problems[pid] = f"pid {pid} is {state if state != NO_CUDA else 'unknown to the driver'}, not running"
            except GpuCheckpointFailed as e:
                problems[pid] = str(e)

    for action in ("restore", "unlock", "check"):
        step(action)
    return list(problems.values())


@contextlib.contextmanager
def suspended(driver: CudaDriver, pids: Sequence[int], *, lock_timeout_ms: int,
              resume: bool = True) -> Iterator[GpuSuspension]:
    """Lock and checkpoint every CUDA process of a tree, for a dump; bring them back afterwards.

    Each process is taken from the state the driver reports: a running one is locked, a locked one
    checkpointed, a checkpointed one left as it is (CRIU's plugin or another tool got there first).
    Every process is locked before any is checkpointed (a process sharing work with another must not
    run on while its peer is copied out). Before yielding, no ``/dev/nvidia*`` mapping may remain.
    Any failure, here or in the body, brings every process back to running and raises
    GpuCheckpointFailed with one line. ``resume=False``: a body that succeeds ended the processes (a
    final dump): nothing to bring back.
    """
    s = GpuSuspension(tuple(pids))
    t0 = time.monotonic()
    try:
        for pid in s.pids:
            state = driver.state(pid)
            if state == "running":
                driver.lock(pid, lock_timeout_ms)
            elif state not in ("locked", "checkpointed"):
                raise GpuCheckpointFailed(f"pid {pid}'s CUDA state is {state}: the driver cannot checkpoint it")
        for pid in s.pids:
            if driver.state(pid) == "locked":
                try:
                    driver.checkpoint(pid)
                except GpuCheckpointFailed as e:
                    raise GpuCheckpointFailed(f"{e} (UVM/managed memory, CUDA IPC memory, MIG or MPS make the "
                                              "driver's checkpoint fail: docs/gpu.md)") from None
        left = {pid: files for pid in s.pids if (files := nvidia_files(pid))}
        if left:
            pid, files = next(iter(left.items()))
            raise GpuCheckpointFailed(f"pid {pid} still maps {', '.join(files)} after its CUDA checkpoint, which "
                                      "CRIU cannot dump")
    except GpuCheckpointFailed as e:
        raise GpuCheckpointFailed(_brought_back(str(e), bring_back(driver, s.pids))) from None
    s.checkpoint_seconds = time.monotonic() - t0
    try:
        yield s
    except BaseException as e:
        problems = bring_back(driver, s.pids)  # the dump failed: its processes are still there, even for a final one
        if problems:
            log.error("GPU state not put back after a failed dump: %s", "; ".join(problems))
        raise e
    if resume:
        t1 = time.monotonic()
        problems = bring_back(driver, s.pids)
        s.resume_seconds = time.monotonic() - t1
        if problems:
            raise GpuCheckpointFailed(f"the dump succeeded, but putting GPU state back failed: {'; '.join(problems)}")


def _brought_back(why: str, problems: list[str]) -> str:
    if problems:
        return f"{why}; bringing the processes back also failed ({'; '.join(problems)}): the workload may be stuck"
    return f"{why}; every process was brought back to running and runs on"


def resume_restored(driver: CudaDriver, pids: Sequence[int]) -> float:
    """After ``criu restore``: put each process's GPU state back and unlock it; the seconds it took.
    GpuCheckpointFailed (one line) when any process is not running after that."""
    t0 = time.monotonic()
    problems = bring_back(driver, pids)
    if problems:
        raise GpuCheckpointFailed("; ".join(problems))
    return time.monotonic() - t0

"""How big will a checkpoint be, before taking it? And is that too big?

A dump writes the tree's resident memory (plus GPU memory, which cuda-checkpoint moves into host
memory first) to the local work directory while the workload is frozen; CRIU froze 1 GB for about
0.6 s here (bench/), so freeze time, local disk and upload all grow with this number. Above
``max_checkpoint_bytes`` a heartbeat is skipped and the workload keeps running unprotected until
it shrinks; the same happens when the work directory could not hold the dump.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..engine.procfs import open_for_writing

__all__ = ["Estimate", "captured_too_large", "estimate_checkpoint", "too_large"]


@dataclass(frozen=True)
class Estimate:
    rss_bytes: int
    gpu_bytes: int
    gpu_by_pid: tuple[tuple[int, int], ...] = ()  # (host pid, GPU memory bytes), for the manifest's gpu block

    @property
    def total(self) -> int:
        return self.rss_bytes + self.gpu_bytes


def _rss(pids: list[int]) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total


def _gpu(pids: list[int]) -> dict[int, int]:
    """GPU memory each of the tree's processes holds, through NVML; empty without pynvml or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        wanted, used = set(pids), dict[int, int]()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid in wanted and p.usedGpuMemory:
                    used[p.pid] = used.get(p.pid, 0) + int(p.usedGpuMemory)
        return used
    except Exception:
        return {}
    finally:
        pynvml.nvmlShutdown()


def estimate_checkpoint(pids: list[int], *, gpu: bool = True) -> Estimate:
    """Resident memory of ``pids`` (shared pages counted once per process: an overestimate) plus
    their GPU memory (``gpu=False``: the caller knows none of them maps a GPU, so NVML is not asked)."""
    used = _gpu(pids) if gpu else {}
    return Estimate(_rss(pids), sum(used.values()), tuple(sorted(used.items())))


def too_large(estimate: Estimate, max_bytes: int, work_dir: Path) -> str | None:
    """Why a checkpoint of this size should not be taken now, or None when it may."""
    if max_bytes and estimate.total > max_bytes:
        return (f"estimate {estimate.total} bytes (rss {estimate.rss_bytes}, gpu {estimate.gpu_bytes}) is above "
                f"max_checkpoint_bytes {max_bytes}")
    free = shutil.disk_usage(work_dir).free
    if estimate.total > free:
        return f"estimate {estimate.total} bytes would not fit in the work directory {work_dir} ({free} bytes free)"
    return None


def captured_too_large(pids: list[int], max_bytes: int) -> str | None:
    """Why the files the tree holds open for writing are too big to copy while it is frozen, or None."""
    if not max_bytes:
        return None
    sizes = {}
    for path in open_for_writing(pids):
        try:
            sizes[path] = os.stat(path).st_size
        except OSError:
            continue
    total = sum(sizes.values())
    if total <= max_bytes:
        return None
    biggest = max(sizes, key=lambda p: sizes[p])
    return (f"files it holds open for writing total {total} bytes, above max_captured_bytes {max_bytes} (the largest: "
            f"{biggest}, {sizes[biggest]} bytes); they would be copied while it is frozen. Keep big outputs out of "
            "the checkpoint: close and reopen them, write a new file per step, or raise max_captured_bytes")

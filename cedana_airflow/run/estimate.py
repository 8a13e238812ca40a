"""How big will a checkpoint be, before taking it? And is that too big?

A dump writes the tree's resident memory (plus GPU memory, which cuda-checkpoint moves into host
memory first) to the local work directory while the workload is frozen; CRIU froze 1 GB for about
0.6 s here (bench/), so freeze time, local disk and upload all grow with this number. Above
``max_checkpoint_bytes`` a heartbeat is skipped and the workload keeps running unprotected until
it shrinks; the same happens when the work directory could not hold the dump. Resident memory misses
what CRIU also writes: memfd contents nobody maps (counted here from the file descriptors), and
whatever the tree allocates between the estimate and the freeze (checked again on the dump itself,
``dump_too_large``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..engine.criu import DumpResult
from ..engine.procfs import open_fds, open_for_writing

__all__ = ["Estimate", "captured_too_large", "dump_too_large", "estimate_checkpoint", "too_large"]


@dataclass(frozen=True)
class Estimate:
    rss_bytes: int
    gpu_bytes: int
    gpu_by_pid: tuple[tuple[int, int], ...] = ()  # (host pid, GPU memory bytes), for the manifest's gpu block
    memfd_bytes: int = 0  # memfd contents the tree holds open: CRIU dumps them, mapped or not

    @property
    def total(self) -> int:
        return self.rss_bytes + self.gpu_bytes + self.memfd_bytes


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


def _memfds(pids: list[int]) -> int:
    """Bytes held by the memfds the tree has open, each file once (an fd shared by a fork counts once).
    A memfd filled with write() is not resident memory of anyone, yet CRIU writes all of it."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid, fd, target in open_fds(pids):
        if not target.startswith("/memfd:"):
            continue
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512  # allocated, not st_size: a sparse memfd dumps only what it holds
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
    """Resident memory of ``pids`` (shared pages counted once per process: an overestimate), their
    memfds' contents, and their GPU memory (``gpu=False``: the caller knows none of them maps a GPU, so
    NVML is not asked)."""
    used = _gpu(pids) if gpu else {}
    return Estimate(_rss(pids), sum(used.values()), tuple(sorted(used.items())), _memfds(pids))


def too_large(estimate: Estimate, max_bytes: int, work_dir: Path) -> str | None:
    """Why a checkpoint of this size should not be taken now, or None when it may."""
    if max_bytes and estimate.total > max_bytes:
        memfd = f", memfd {estimate.memfd_bytes}" if estimate.memfd_bytes else ""
        return (f"estimate {estimate.total} bytes (rss {estimate.rss_bytes}, gpu {estimate.gpu_bytes}{memfd}) is "
                f"above max_checkpoint_bytes {max_bytes}")
    existing = next(p for p in (work_dir, *work_dir.parents) if p.exists())  # the first dump creates work_dir
    free = shutil.disk_usage(existing).free
    if estimate.total > free:
        return f"estimate {estimate.total} bytes would not fit in the work directory {work_dir} ({free} bytes free)"
    return None


def dump_too_large(dump: DumpResult, max_bytes: int) -> str | None:
    """Why a dump already taken is too large to store, or None: the tree grew between its estimate
    and the freeze (a tensor allocated in that second), so the limit is checked on what CRIU wrote."""
    if not max_bytes:
        return None
    size = sum(p.stat().st_size for p in dump.image_dir.iterdir() if p.is_file())
    size += sum(copy.stat().st_size for _, copy, _ in dump.captured)
    if size <= max_bytes:
        return None
    return (f"dump {size} bytes (the tree grew after its estimate) is above max_checkpoint_bytes {max_bytes}")


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
    return _captured_line(sizes, max_bytes)


def copies_too_large(dump: DumpResult, max_bytes: int) -> str | None:
    """Why the copies a dump took are above max_captured_bytes, or None: a file that grew between the
    estimate and the freeze (the time the dump's checks before CRIU take) is judged on what was copied."""
    if not max_bytes:
        return None
    return _captured_line({path: copy.stat().st_size for path, copy, _ in dump.captured}, max_bytes)


def _captured_line(sizes: dict[str, int], max_bytes: int) -> str | None:
    total = sum(sizes.values())
    if total <= max_bytes:
        return None
    biggest = max(sizes, key=lambda p: sizes[p])
    return (f"files it holds open for writing total {total} bytes, above max_captured_bytes {max_bytes} (the largest: "
            f"{biggest}, {sizes[biggest]} bytes); they would be copied while it is frozen. Keep big outputs out of "
            "the checkpoint: close and reopen them, write a new file per step, or raise max_captured_bytes")

"""Transparent huge pages a restore took away, given back (``MADV_COLLAPSE``).

A process that asks for huge pages (``madvise(MADV_HUGEPAGE)``: numpy does for every array of 4 MiB
or more), or runs where THP is ``always``, holds its anonymous memory in 2 MiB pages. A restore
brings that memory back 4 KiB at a time: ``criu restore`` fills premapped memory and applies the
VMAs' madvise bits last (its restorer: "Finally restore madvise() bits"), and a lazy restore's
``UFFDIO_COPY`` installs 4 KiB pages. The VMA keeps its THP flag, so khugepaged collapses it in the
end, at its default pace of 4,096 pages per 10 s: a GiB takes ten minutes. Until then each
heartbeat's dump walks and splices 512 times as many page mappings, and the workload runs on 4 KiB
TLB entries (bench/lazy_freeze.py measures the freeze: bench/README.md).

:func:`collapse` does at once what khugepaged would do: ``process_madvise(MADV_COLLAPSE)`` (Linux
6.1) over the huge-page ranges a fresh process would hold in huge pages. The kernel says which VMAs
those are (``THPeligible`` in smaps: the sysfs policy, the VMA's flags, ``PR_SET_THP_DISABLE``), and
a range is collapsed only with as many of its pages present as khugepaged asks for
(``max_ptes_none``; by default one), never one with none. VMAs still registered with a userfaultfd
(a lazy restore's pages still coming) are left alone. Best effort: a range the kernel refuses (a
page pinned or locked, no free huge page) stays as it was, and is counted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import re
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Collapsed", "STEP_BYTES", "collapse", "huge_page_bytes", "plan", "plan_huge"]

_THP = Path("/sys/kernel/mm/transparent_hugepage")


@functools.cache
def huge_page_bytes() -> int:
    """A huge page: 2 MiB on x86-64 (and arm64 with 4 KiB pages); asked on first use, not at import
    (importing our modules does no I/O: the CLI's start-up)."""
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


_PAGE = mmap.PAGESIZE


def _per_huge() -> int:
    return huge_page_bytes() // _PAGE
MADV_COLLAPSE = 25
_SYS_PROCESS_MADVISE = 440  # one number on every architecture (syscalls from 424 on are shared)
_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)")
_PFN = (1 << 55) - 1  # a pagemap entry's page frame number (bits 0-54; 0 without CAP_SYS_ADMIN)
_UFFD_FLAGS = {"um", "uw", "ui"}  # registered with a userfaultfd: missing, write-protect, minor
#: What one process_madvise call asks for at most: between calls the caller's gate is let go (a
#: heartbeat waits for one step at most: 0.03-0.12 s here, 256 MiB took 0.25-0.96 s on 2 busy cores).
STEP_BYTES = 32 << 20


@dataclass
class Collapsed:
    """What :func:`collapse` did, for the log."""

    asked_bytes: int = 0  # the huge-page ranges asked to be collapsed
    huge_before: int = 0  # anonymous bytes in huge pages before (smaps AnonHugePages), eligible VMAs only
    huge_after: int = 0
    seconds: float = 0.0
    refused: dict[str, int] = field(default_factory=dict)  # errno name -> calls refused
    why_not: str = ""  # why it stopped short of the plan ("" when it did not)


def _max_ptes_none() -> int:
    try:
        return int((_THP / "khugepaged" / "max_ptes_none").read_text())
    except (OSError, ValueError):
        return _per_huge() - 1  # the kernel's default


def _eligible_vmas(pid: int) -> Iterator[tuple[int, int, int, int]]:
    """(start, end, anonymous bytes, huge bytes) of each VMA a fresh process of ``pid``'s would hold in
    huge pages: private anonymous, THPeligible, not registered with a userfaultfd."""
    start = end = anon = huge = 0
    private_anon = eligible = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _HEAD.match(line)
            if m:
                start, end = int(m.group(1), 16), int(m.group(2), 16)
                private_anon = m.group(3)[3] == "p" and m.group(4) == "0"
                anon = huge = 0
                eligible = False
            elif line.startswith("Anonymous:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("AnonHugePages:"):
                huge = int(line.split()[1]) * 1024
            elif line.startswith("THPeligible:"):
                eligible = line.split()[1] == "1"
            elif line.startswith("VmFlags:"):  # the last line of each VMA's entry
                if private_anon and eligible and anon and not _UFFD_FLAGS & set(line.split()[1:]):
                    yield start, end, anon, huge


def plan(pid: int, max_ptes_none: int | None = None) -> tuple[list[tuple[int, int]], int]:
    """The ranges of ``pid`` to collapse ([start, end), huge-page-aligned, adjacent ones merged), and the
    bytes already in huge pages in its eligible VMAs. A huge page's range qualifies with at most
    ``max_ptes_none`` pages absent (default: khugepaged's), and at least one present."""
    need = _per_huge() - (_max_ptes_none() if max_ptes_none is None else max_ptes_none)
    need = max(1, min(_per_huge(), need))
    out: list[tuple[int, int]] = []
    huge_bytes = 0
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm:
        for start, end, anon, huge in _eligible_vmas(pid):
            huge_bytes += huge
            if anon <= huge:  # all of it in huge pages already
                continue
            hp = huge_page_bytes()
            lo, hi = -(-start // hp) * hp, end // hp * hp
            for at in range(lo, hi, hp):
                entries = [e for (e,) in struct.iter_unpack("=Q", os.pread(pm.fileno(), 8 * _per_huge(), at // _PAGE * 8))]
                present = sum(1 for e in entries if e >> 63)
                if present >= need and not _one_huge_page(entries):
                    if out and out[-1][1] == at:
                        out[-1] = (out[-1][0], at + hp)
                    else:
                        out.append((at, at + hp))
    return out, huge_bytes


def _one_huge_page(entries: list[int]) -> bool:
    """Whether these pagemap entries (one huge page's worth) map one huge page already: all present,
    their frames (root reads them) consecutive from a huge-page-aligned one."""
    first = entries[0] & _PFN
    return (first != 0 and first % _per_huge() == 0
            and all(e >> 63 and e & _PFN == first + i for i, e in enumerate(entries)))


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _process_madvise(pidfd: int, start: int, length: int, advice: int) -> int:
    """0, or the errno of the call."""
    iov = _Iovec(start, length)
    r = _libc.syscall(ctypes.c_long(_SYS_PROCESS_MADVISE), ctypes.c_int(pidfd), ctypes.byref(iov),
                      ctypes.c_size_t(1), ctypes.c_int(advice), ctypes.c_uint(0))
    return 0 if r >= 0 else ctypes.get_errno()


def collapse(pids: list[int], *, gate: Callable[[], AbstractContextManager[object]] | None = None,
             stop: Callable[[], bool] | None = None, step_bytes: int = STEP_BYTES) -> Collapsed:
    """Collapse into huge pages what ``pids`` would hold in them as fresh processes (see the module's
    doc). Each call of at most ``step_bytes`` runs inside ``gate()`` (the caller's lock: no dump while
    it runs); ``stop()`` true ends it early. Never raises for a process that went away."""
    res = Collapsed()
    t0 = time.monotonic()
    if not _THP.is_dir():
        res.why_not = "this kernel has no transparent huge pages"
        return res
    for pid in pids:
        try:
            ranges, huge = plan(pid)
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue  # gone
        res.huge_before += huge
        try:
            if not _collapse_ranges(pidfd, ranges, res, gate, stop, step_bytes):
                break
        finally:
            os.close(pidfd)
    for pid in pids:
        with contextlib.suppress(OSError):
            res.huge_after += plan_huge(pid)
    res.seconds = time.monotonic() - t0
    return res


def _collapse_ranges(pidfd: int, ranges: list[tuple[int, int]], res: Collapsed,
                     gate: Callable[[], AbstractContextManager[object]] | None, stop: Callable[[], bool] | None,
                     step_bytes: int) -> bool:
    """One process's ranges; False when the rest of the tree should not be tried either."""
    for start, end in ranges:
        for at in range(start, end, step_bytes):
            if stop is not None and stop():
                return False
            n = min(step_bytes, end - at)
            with gate() if gate is not None else contextlib.nullcontext():
                err = _process_madvise(pidfd, at, n, MADV_COLLAPSE)
            res.asked_bytes += n
            if not err:
                continue
            name = errno.errorcode.get(err, str(err))
            res.refused[name] = res.refused.get(name, 0) + 1
            if err == errno.ESRCH:
                return True  # this process is gone; its tree's others may not be
            if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # before Linux 6.1, or not allowed
                res.why_not = f"process_madvise(MADV_COLLAPSE): {os.strerror(err)}"
                return False
            # EAGAIN (a page pinned or locked), ENOMEM (no free huge page): this step stays as it was
    return True


def plan_huge(pid: int) -> int:
    """Bytes already in huge pages in ``pid``'s eligible VMAs."""
    return sum(huge for _, _, _, huge in _eligible_vmas(pid))

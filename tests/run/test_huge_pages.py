"""Huge pages given back after a restore (engine/thp.py), on live processes: only what a fresh process
would hold in huge pages is collapsed (asked for, or THP "always"; as populated as khugepaged asks),
never a VMA still registered with a userfaultfd, and a process that went away is no error."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from cedana_airflow.engine import thp

MiB = 1 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = [
    pytest.mark.skipif(not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages here"),
    pytest.mark.skipif(os.geteuid() != 0, reason="process_madvise needs CAP_SYS_NICE, the page frames need root"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the child registers a userfaultfd by x86-64's numbers"),
]

# A child with three private anonymous regions of 16 MiB, each 2 MiB-aligned: "filled" written in 4 KiB
# pages and only then asked for huge pages (as a restore leaves numpy's state), "sparse" likewise with
# one page per 2 MiB, "never" written but never asked; then "registered", filled, asked for huge pages
# and registered with a userfaultfd (a lazy restore's VMA whose pages are still coming).
_CHILD = r"""
import ctypes, mmap, os, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
M, H = 16 << 20, 2 << 20
def region():
    raw = libc.mmap(None, M + H, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|MAP_ANONYMOUS
    at = (raw + H - 1) // H * H
    return at
def touch(at, step):
    for off in range(0, M, step):
        ctypes.memset(at + off, 1, 4096)
def madvise(at, advice):
    assert libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(M), advice) == 0, ctypes.get_errno()
NOHUGE, HUGE = 15, 14
out = {}
for name, step in (("filled", 4096), ("sparse", H), ("never", 4096), ("registered", 4096)):
    at = region()
    madvise(at, NOHUGE)  # 4 KiB pages however THP is set
    touch(at, step)
    if name != "never":
        madvise(at, HUGE)
    else:
        madvise(at, NOHUGE)
    out[name] = at
ufd = libc.syscall(323, os.O_CLOEXEC | os.O_NONBLOCK)
api = ctypes.create_string_buffer(struct.pack("=QQQ", 0xAA, 0, 0))
assert libc.ioctl(ufd, ctypes.c_ulong(0xC018AA3F), api) == 0
reg = ctypes.create_string_buffer(struct.pack("=QQQQ", out["registered"], M, 1, 0))  # UFFDIO_REGISTER_MODE_MISSING
assert libc.ioctl(ufd, ctypes.c_ulong(0xC020AA00), reg) == 0, ctypes.get_errno()
print(" ".join(f"{k}={v}" for k, v in out.items()), flush=True)
time.sleep(120)
"""


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line, "the child did not start"
        yield p.pid, {k: int(v) for k, v in (kv.split("=") for kv in line.split())}
    finally:
        p.kill()
        p.wait()


def _huge_in(pid: int, start: int, size: int = 16 * MiB) -> int:
    """AnonHugePages of the VMA holding [start, start + size)."""
    entry = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not line.startswith("VmFlags") and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = lo <= start and start + size <= hi
        elif entry and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VMA at {start:#x}")


def _covered(ranges: list[tuple[int, int]], start: int, size: int = 16 * MiB) -> int:
    return sum(max(0, min(e, start + size) - max(s, start)) for s, e in ranges)


def _planned_or_huge(pid: int, ranges: list[tuple[int, int]], start: int) -> int:
    """Bytes of the region either planned or already in huge pages: khugepaged may collapse a region of the
    child's (it scans VMAs asked for huge pages) at any moment; read after the plan, one that was huge
    then is still huge now."""
    return _covered(ranges, start) + _huge_in(pid, start)


def test_only_what_a_fresh_process_would_hold_in_huge_pages_is_planned(child):
    pid, at = child
    ranges, _ = thp.plan(pid, max_ptes_none=511)
    assert _planned_or_huge(pid, ranges, at["filled"]) >= 16 * MiB
    assert _planned_or_huge(pid, ranges, at["sparse"]) >= 16 * MiB  # khugepaged's default: one page present is enough
    assert _covered(ranges, at["never"]) == 0  # never asked for huge pages (madvise NOHUGEPAGE)
    assert _covered(ranges, at["registered"]) == 0  # a userfaultfd's: its pages may still be coming
    # as populated as khugepaged asks: with max_ptes_none 0, only full 2 MiB ranges
    strict, _ = thp.plan(pid, max_ptes_none=0)
    assert _planned_or_huge(pid, strict, at["filled"]) >= 16 * MiB and _covered(strict, at["sparse"]) == 0


def test_collapse_gives_back_huge_pages_and_a_second_one_has_nothing_left_to_do(child):
    pid, at = child
    gated = []

    class Gate:
        def __enter__(self) -> None:
            gated.append(1)

        def __exit__(self, *exc: object) -> None:
            pass

    planned = thp.plan(pid)[0]
    res = thp.collapse([pid], gate=Gate, step_bytes=4 * MiB)
    if res.why_not:
        pytest.skip(f"this kernel cannot collapse on request: {res.why_not}")
    assert _huge_in(pid, at["filled"]) >= 14 * MiB, res  # (a 2 MiB block may be refused on a fragmented machine)
    assert _huge_in(pid, at["never"]) == 0
    # a VMA registered with a userfaultfd is never asked for (khugepaged itself may collapse a block of it
    # whose pages are all present: it did once in a clean-clone run, so its huge pages are no measure)
    assert _covered(planned, at["registered"]) == 0
    assert res.huge_after > res.huge_before
    assert len(gated) >= 4 or res.huge_before >= 28 * MiB  # steps of 4 MiB, each inside the gate (unless khugepaged was first)
    again = thp.collapse([pid])
    assert _covered(thp.plan(pid)[0], at["filled"]) <= 2 * MiB  # already huge pages: not asked again
    assert again.huge_after >= res.huge_after - 2 * MiB


def test_a_process_that_went_away_is_no_error():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    res = thp.collapse([p.pid])
    assert res.asked_bytes == 0 and not res.refused


def test_stop_ends_it_before_the_first_step(child):
    pid, at = child
    res = thp.collapse([pid], stop=lambda: True)
    assert res.asked_bytes == 0 and not res.refused

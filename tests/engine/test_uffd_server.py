"""Our lazy-pages daemon against the kernel's userfaultfd, with a child process playing the restored one.

The child registers a region of its memory with a uffd and hands it over the daemon's socket as
``criu restore --lazy-pages`` does; then it faults, drops memory, forks, and reads everything back.
The pages come from a made-up image: what the region holds must be that image, page for page, and
zeros where the process dropped its memory (madvise) or where the image has nothing.
"""

from __future__ import annotations

import os
import platform
import random
import select
import struct
import subprocess
import sys
import threading
import time

import pytest

from conftest import varint

from cedana_airflow.engine.pagemap import PAGE_SIZE, PE_LAZY, PE_PRESENT, Pagemap, PageRun
from cedana_airflow.engine.uffd import _SYS_USERFAULTFD as _SYSCALLS, kernel_lazy_pages
from cedana_airflow.engine.uffd_server import FAULT_AROUND_BYTES, UffdServer, _Task, lazy_iovs, read_vmas

MiB = 1 << 20
_SYS_USERFAULTFD = _SYSCALLS.get(platform.machine())

needs_uffd = pytest.mark.skipif(os.geteuid() != 0 or _SYS_USERFAULTFD is None or not (kernel_lazy_pages() or (False,))[0],
                                reason="needs root and a kernel with userfaultfd events")


def _field(num: int, payload: bytes) -> bytes:
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def _mm_image(vmas: list[tuple[int, int]]) -> bytes:
    body = varint(1 << 3) + varint(0) + b"".join(
        _field(14, varint(1 << 3) + varint(s) + varint(2 << 3) + varint(e)) for s, e in vmas)
    return struct.pack("<II", 0x54564319, 0x57492820) + struct.pack("<I", len(body)) + body


def test_lazy_runs_become_iovs_split_where_a_vma_ends_and_eager_runs_are_left_out(tmp_path):
    (tmp_path / "mm-5.img").write_bytes(_mm_image([(0x10000, 0x14000), (0x14000, 0x30000)]))
    vmas = read_vmas(tmp_path, 5)
    assert vmas == [(0x10000, 0x14000), (0x14000, 0x30000)]
    pm = Pagemap(5, 1, (PageRun(0x10000, 2, PE_PRESENT, 0), PageRun(0x12000, 6, PE_PRESENT | PE_LAZY, 2 * PAGE_SIZE)))
    assert lazy_iovs(pm, vmas) == [[0x12000, 0x14000, 0x12000], [0x14000, 0x18000, 0x14000]]


def test_a_task_gives_each_page_once_and_follows_a_remap_with_its_image_address():
    t = _Task(1, -1, [[0x10000, 0x20000, 0x10000]])
    assert t.take(0x12000, 0x13000) == [(0x12000, 0x13000, 0x12000)]
    assert t.take(0x12000, 0x13000) == []  # given already
    t.remap(0x14000, 0x90000, 0x2000)  # mremap: the pages move, their bytes are still at the old image address
    assert t.iovs == [[0x10000, 0x12000, 0x10000], [0x13000, 0x14000, 0x13000], [0x16000, 0x20000, 0x16000],
                      [0x90000, 0x92000, 0x14000]]
    assert t.find(0x91000) == 3 and t.find(0x12000) == -1


#: The restored process, played by a child of the test (single-threaded: a fork or an madvise waits
#: for the daemon to read its event, and the daemon is a thread of the test's process, so the process
#: that forks must be another one). It maps 8 MiB at ADDR, registers it with a uffd as CRIU's restorer
#: does, hands the uffd over the daemon's socket as criu restore does, then touches its memory when
#: told (a line on stdin) and says what it saw (a line on stdout).
_PROCESS = r"""
import ctypes, fcntl, os, random, socket, struct, sys
MiB, ADDR, SIZE, LAZY = 1 << 20, int(sys.argv[2]), 8 << 20, 6 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
assert libc.mmap(ADDR, SIZE, 3, 0x22 | 0x100000, -1, 0) == ADDR  # private anonymous, MAP_FIXED_NOREPLACE
uffd = libc.syscall(int(sys.argv[3]), os.O_CLOEXEC | os.O_NONBLOCK)
fcntl.ioctl(uffd, 0xC018AA3F, bytearray(struct.pack("=QQQ", 0xAA, (1 << 1) | (1 << 2) | (1 << 3) | (1 << 6), 0)))
fcntl.ioctl(uffd, 0xC020AA00, bytearray(struct.pack("=QQQQ", ADDR, SIZE, 1, 0)))  # missing pages
image = random.Random(7).randbytes(LAZY)
def read(off, n):
    buf = ctypes.create_string_buffer(n)
    ctypes.memmove(buf, ADDR + off, n)
    return buf.raw
crit = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
dfd = os.open(sys.argv[1], os.O_PATH)
crit.connect(f"/proc/self/fd/{dfd}/lazy-pages.socket")
crit.send(struct.pack("=i", 1))
socket.send_fds(crit, [b"\0"], [uffd])
os.close(uffd)  # the daemon's copy is the one that counts now
def say(ok):
    print("ok" if ok else "wrong", flush=True)
for line in sys.stdin:
    step = line.strip()
    if step == "fault":
        at = 3 * MiB + 5 * 4096 + 7
        say(read(at, 100) == image[at : at + 100] and read(3 * MiB, MiB) == image[3 * MiB : 4 * MiB])
    elif step == "drop-and-fork":
        # drop 1 MiB not yet faulted in: its image bytes must never come back there
        assert libc.madvise(ctypes.c_void_p(ADDR + MiB), ctypes.c_size_t(MiB), 4) == 0  # MADV_DONTNEED
        pid = os.fork()  # a child shares what is missing: its faults come on a uffd of its own
        if pid == 0:
            os._exit(0 if read(5 * MiB, MiB) == image[5 * MiB : 6 * MiB] and read(MiB, 16) == bytes(16) else 1)
        say(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0)
    elif step == "finish":
        crit.send(struct.pack("=I", 0x52535446))  # the restore has finished: the background may run
        say(True)
    elif step == "all":
        got = read(0, SIZE)
        say(got[:MiB] == image[:MiB] and got[2 * MiB : LAZY] == image[2 * MiB :]
            and got[MiB : 2 * MiB] == bytes(MiB) and got[LAZY:] == bytes(SIZE - LAZY))
"""


def _eventually(check, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@needs_uffd
def test_faults_are_answered_with_the_window_around_them_then_the_rest_comes_in_the_background(tmp_path):
    addr, size, lazy = 0x5E0000000000, 8 * MiB, 6 * MiB  # the last 2 MiB were never dumped: zeros
    image = random.Random(7).randbytes(lazy)
    (tmp_path / "mm-1.img").write_bytes(_mm_image([(addr, addr + size)]))
    pm = Pagemap(1, 1, (PageRun(addr, lazy // PAGE_SIZE, PE_PRESENT | PE_LAZY, 0),))
    failures: list[BaseException] = []
    done = threading.Event()
    server = UffdServer(tmp_path, {1: pm}, lambda pid, img, nr: [image[img - addr : img - addr + nr * PAGE_SIZE]],
                        failures.append, lambda ok: done.set() if ok else None)
    server.listen()
    proc = subprocess.Popen([sys.executable, "-c", _PROCESS, str(tmp_path), str(addr), str(_SYS_USERFAULTFD)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def step(name: str) -> str:
        proc.stdin.write(name + "\n")
        proc.stdin.flush()
        if not select.select([proc.stdout], [], [], 20)[0]:
            return "no answer: a fault was never served"
        return proc.stdout.readline().strip()

    try:
        assert step("fault") == "ok"
        # one fault, its whole window (counted just after the copy that woke the reader: wait for it)
        assert _eventually(lambda: (server.requests, server.served_bytes) == (1, FAULT_AROUND_BYTES)), \
            (server.requests, server.served_bytes)
        assert step("drop-and-fork") == "ok", "the forked child did not see its image, or saw the dropped MiB"
        assert step("finish") == "ok"
        assert done.wait(20), f"not every page came in: {failures}"
        assert not failures
        assert step("all") == "ok"  # the image page for page, zeros where dropped or never dumped
        # each page once per process: the parent's all but the dropped MiB, the child's one window
        assert server.served_bytes == lazy - MiB + FAULT_AROUND_BYTES
    finally:
        proc.kill()
        proc.wait()
        server.close()

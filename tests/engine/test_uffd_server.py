"""Our lazy-pages daemon against the kernel's userfaultfd, with a child process playing the restored one.

The child registers a region of its memory with a uffd and hands it over the daemon's socket as
``criu restore --lazy-pages`` does; then it faults, drops memory, forks, and reads everything back.
The pages come from a made-up image: what the region holds must be that image, page for page, and
zeros where the process dropped its memory (madvise) or where the image has nothing.
"""

from __future__ import annotations

import fcntl
import os
import platform
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from conftest import varint

from cedana_airflow.engine.pagemap import PAGE_SIZE, PE_LAZY, PE_PRESENT, Pagemap, PageRun
from cedana_airflow.engine.uffd import _SYS_USERFAULTFD as _SYSCALLS, kernel_lazy_pages
from cedana_airflow.engine.uffd_server import FAULT_AROUND_BYTES, UffdServer, _Task, lazy_iovs, read_vmas, recv_fds

MiB = 1 << 20
_SYS_USERFAULTFD = _SYSCALLS.get(platform.machine())

needs_uffd = pytest.mark.skipif(os.geteuid() != 0 or _SYS_USERFAULTFD is None or not (kernel_lazy_pages() or (False,))[0],
                                reason="needs root and a kernel with userfaultfd events")


def _field(num: int, payload: bytes) -> bytes:
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def _mm_image(vmas: list[tuple[int, int]] | list[tuple[int, int, int]]) -> bytes:
    """An mm image: each VMA's start, end and, when given, its madvise bits (vma.proto field 9)."""
    body = varint(1 << 3) + varint(0) + b"".join(
        _field(14, varint(1 << 3) + varint(v[0]) + varint(2 << 3) + varint(v[1])
               + (varint(9 << 3) + varint(v[2]) if len(v) > 2 else b"")) for v in vmas)
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


#: What both restored processes below do first: map 8 MiB at ADDR, register it with a uffd as CRIU's
#: restorer does, and hand the uffd over the daemon's socket as criu restore does.
_HANDOVER = r"""
import ctypes, fcntl, hashlib, os, random, socket, struct, sys, threading
ADDR, SIZE = int(sys.argv[2]), 8 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
for name in ("mprotect", "madvise", "munmap"):
    getattr(libc, name).argtypes = (ctypes.c_void_p, ctypes.c_size_t) + ((ctypes.c_int,) if name != "munmap" else ())
assert libc.mmap(ADDR, SIZE, 3, 0x22 | 0x100000, -1, 0) == ADDR  # private anonymous, MAP_FIXED_NOREPLACE
uffd = libc.syscall(int(sys.argv[3]), os.O_CLOEXEC | os.O_NONBLOCK)
fcntl.ioctl(uffd, 0xC018AA3F, bytearray(struct.pack("=QQQ", 0xAA, (1 << 1) | (1 << 2) | (1 << 3) | (1 << 6), 0)))
fcntl.ioctl(uffd, 0xC020AA00, bytearray(struct.pack("=QQQQ", ADDR, SIZE, 1, 0)))  # missing pages
crit = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
dfd = os.open(sys.argv[1], os.O_PATH)
crit.connect(f"/proc/self/fd/{dfd}/lazy-pages.socket")
crit.send(struct.pack("=i", 1))
socket.send_fds(crit, [b"\0"], [uffd])
os.close(uffd)  # the daemon's copy is the one that counts now
"""

#: The restored process, played by a child of the test (single-threaded: a fork or an madvise waits
#: for the daemon to read its event, and the daemon is a thread of the test's process, so the process
#: that forks must be another one). It maps 8 MiB at ADDR, registers it with a uffd as CRIU's restorer
#: does, hands the uffd over the daemon's socket as criu restore does, then touches its memory when
#: told (a line on stdin) and says what it saw (a line on stdout).
_PROCESS = _HANDOVER + r"""
MiB, LAZY = 1 << 20, 6 << 20
image = random.Random(7).randbytes(LAZY)
def read(off, n):
    buf = ctypes.create_string_buffer(n)
    ctypes.memmove(buf, ADDR + off, n)
    return buf.raw
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


# -- what a process does to its memory right after a restore (issue 46) -------------------------------
#: A restored process for the tests below: 8 MiB at ADDR registered with a uffd (6 MiB of image, then
#: zeros), handed over as criu restore does. It follows commands (a line each) and answers a line:
#:   read OFF LEN              the sha256 of those bytes (faults them in)
#:   thread-read OFF LEN       a thread reads them (and blocks on its fault); "started"
#:   join                      the sha256 of each thread's read, in order
#:   fork-read OFF LEN         a forked child reads them; their sha256
#:   mprotect OFF LEN PROT | madvise OFF LEN [ADVICE] | munmap OFF LEN    "ok" (0 from libc)
#:   forks N                   N children, each exits at once; "ok"
#:   finish                    tells the daemon the restore has finished; "ok"
_TREE = _HANDOVER + r"""
def sha(off, n):
    buf = ctypes.create_string_buffer(n)
    ctypes.memmove(buf, ADDR + off, n)  # (ctypes lets go of the GIL: a thread may block in its fault)
    return hashlib.sha256(buf.raw).hexdigest()
threads, results = [], []
def say(s):
    print(s, flush=True)
for line in sys.stdin:
    cmd, *a = line.split()
    a = [int(x, 0) for x in a]
    if cmd == "read":
        say(sha(*a))
    elif cmd == "thread-read":
        t = threading.Thread(target=lambda: results.append(sha(*a)))
        t.start()
        threads.append(t)
        say("started")
    elif cmd == "join":
        for t in threads:
            t.join()
        say(" ".join(results))
    elif cmd == "fork-read":
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, sha(*a).encode())
            os._exit(0)
        os.close(w)
        got = os.read(r, 64).decode()
        os.waitpid(pid, 0)
        say(got)
    elif cmd in ("mprotect", "madvise", "munmap"):
        extra = a[2:] if cmd == "mprotect" else (a[2:] or [4]) if cmd == "madvise" else []  # MADV_DONTNEED
        say("ok" if getattr(libc, cmd)(ADDR + a[0], a[1], *extra) == 0 else f"errno {ctypes.get_errno()}")
    elif cmd == "forks":
        for _ in range(a[0]):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        say("ok")
    elif cmd == "finish":
        crit.send(struct.pack("=I", 0x52535446))
        say("ok")
"""

_ADDR, _SIZE, _LAZY = 0x5F0000000000, 8 * MiB, 6 * MiB
_IMAGE = random.Random(46).randbytes(_LAZY)


def _sha(data: bytes) -> str:
    import hashlib
    return hashlib.sha256(data).hexdigest()


def _image(off: int, n: int) -> str:
    """What the restored process must read at [off, off + n): the image, then zeros where none was dumped."""
    return _sha(_IMAGE[off : off + n] + bytes(max(0, off + n - max(off, _LAZY))))


class _Tree:
    """The daemon and a child playing the restored tree, with what went to on_failure and on_done."""

    def __init__(self, tmp_path, pages=None, vmas=None) -> None:
        (tmp_path / "mm-1.img").write_bytes(_mm_image(vmas or [(_ADDR, _ADDR + _SIZE)]))
        pm = Pagemap(1, 1, (PageRun(_ADDR, _LAZY // PAGE_SIZE, PE_PRESENT | PE_LAZY, 0),))
        self.failures: list[BaseException] = []
        self.done: list[bool] = []
        self.ended = threading.Event()

        def on_done(ok: bool) -> None:
            self.done.append(ok)
            self.ended.set()

        def image(pid, img, nr):
            return [_IMAGE[img - _ADDR : img - _ADDR + nr * PAGE_SIZE]]
        self.server = UffdServer(tmp_path, {1: pm}, pages or image, self.on_failure, on_done)
        self.server.listen()
        self.proc = subprocess.Popen([sys.executable, "-c", _TREE, str(tmp_path), str(_ADDR), str(_SYS_USERFAULTFD)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def on_failure(self, e: BaseException) -> None:
        self.failures.append(e)
        self.proc.kill()  # as the lazy restore does: the tree dies, then the daemon is let go
        self.proc.wait()
        self.server.release()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self, seconds: float = 20) -> str:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], seconds)[0]:
            return f"no answer in {seconds} s: the tree hangs (failures: {self.failures})"
        return self.proc.stdout.readline().strip() or f"the tree died (failures: {self.failures})"

    def step(self, line: str, seconds: float = 20) -> str:
        self.send(line)
        return self.answer(seconds)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.server.close()


@pytest.fixture
def tree(tmp_path):
    made: list[_Tree] = []

    def make(**kw) -> _Tree:
        made.append(_Tree(tmp_path, **kw))
        return made[-1]
    yield make
    for t in made:
        t.close()


def _gate(monkeypatch, server: UffdServer) -> threading.Event:
    """Hold the daemon before its first read of a uffd, so that what the tree does next queues behind it."""
    gate, read = threading.Event(), server._read
    monkeypatch.setattr(server, "_read", lambda task, ev: (gate.wait(20), read(task, ev))[1])
    return gate


@needs_uffd
def test_a_window_that_crosses_a_vma_end_made_after_the_restore_is_served_whole(tree):
    """mprotect on part of a region (glibc's arenas, the JVM's and Go's heaps) splits its VMA with no
    event: the fault's 1 MiB window crossed the new ends, every copy was refused (ENOENT), and after
    1,000 tries the window was dropped: the fault never answered, or the pages read as zeros."""
    t = tree()
    assert t.step(f"mprotect {256 << 10} {256 << 10} 1") == "ok"  # a read-only island in the first window
    assert t.step(f"mprotect {3 * MiB + (64 << 10)} {64 << 10} 1") == "ok"
    assert t.step(f"read {300 << 10} 4096", 10) == _image(300 << 10, 4096)  # a fault inside the island
    assert t.step(f"read 0 {2 * MiB}", 10) == _image(0, 2 * MiB)
    assert t.step("finish") == "ok"
    assert t.ended.wait(20) and t.done == [True], t.failures
    assert t.step(f"read 0 {_SIZE}") == _image(0, _SIZE)  # the background went round the islands too
    assert t.server.unmapped_bytes == 0


@needs_uffd
def test_a_fork_read_with_a_fault_is_applied_before_the_fault_is_served(tree, monkeypatch):
    """read() gives pending faults before events. A thread's fault and another thread's fork, read
    together: serving the fault first took its window out of the bookkeeping the fork then copied,
    and the forked child read zeros where the image has its bytes."""
    slow = threading.Event()

    def pages(pid, img, nr):  # the first copy comes late enough for the fork to have gone on (no EAGAIN)
        if not slow.is_set():
            slow.set()
            time.sleep(0.3)
        return [_IMAGE[img - _ADDR : img - _ADDR + nr * PAGE_SIZE]]
    t = tree(pages=pages)
    gate = _gate(monkeypatch, t.server)
    assert t.step(f"thread-read {MiB} 4096") == "started"  # blocks on its fault: the daemon waits at the gate
    t.send(f"fork-read {MiB} {MiB}")  # the fork waits until the daemon reads its event
    time.sleep(0.5)
    gate.set()
    assert t.answer() == _image(MiB, MiB), "the forked child did not read the image"
    assert t.step("join") == _image(MiB, 4096)
    assert not t.failures


@needs_uffd
def test_memory_purged_then_unmapped_before_the_daemon_unregisters_it_is_no_failure(tree, monkeypatch):
    """madvise(DONTNEED) then munmap of the same range: reading the REMOVE lets the process go on, and
    it unmapped the range before UFFDIO_UNREGISTER, which then said EINVAL: the tree was killed and
    restored again in full."""
    from cedana_airflow.engine import uffd_server
    ioctl = uffd_server._ioctl

    def slow_unregister(fd, request, arg):
        if request == uffd_server._UFFDIO_UNREGISTER:
            time.sleep(0.5)  # the process munmaps meanwhile
        return ioctl(fd, request, arg)
    monkeypatch.setattr(uffd_server, "_ioctl", slow_unregister)
    t = tree()
    assert t.step(f"madvise {MiB} {MiB}") == "ok"
    assert t.step(f"munmap {MiB} {MiB}") == "ok"
    assert t.step(f"read {2 * MiB} {MiB}") == _image(2 * MiB, MiB), t.failures
    assert t.step("finish") == "ok"
    assert t.ended.wait(20) and t.done == [True] and not t.failures, t.failures


@needs_uffd
def test_a_process_that_exits_with_faults_still_to_serve_ends_the_serving_cleanly(tree, monkeypatch):
    """Two threads' faults read in one batch, and the process is gone before the first is copied
    (ESRCH): its fd was closed and the second fault used it (EBADF, or a reused number), and the tree
    was taken as failed: a workload that had exited 0 was run again from its checkpoint."""
    release, first = threading.Event(), threading.Event()

    def pages(pid, img, nr):
        if not first.is_set():
            first.set()
            release.wait(20)  # the process dies meanwhile
        return [_IMAGE[img - _ADDR : img - _ADDR + nr * PAGE_SIZE]]
    t = tree(pages=pages)
    gate = _gate(monkeypatch, t.server)
    assert t.step("thread-read 0 4096") == "started"
    assert t.step(f"thread-read {2 * MiB} 4096") == "started"
    assert t.step("finish") == "ok"
    time.sleep(0.5)
    gate.set()
    assert first.wait(20)
    t.proc.kill()
    t.proc.wait()
    release.set()
    assert t.ended.wait(20), "the daemon did not stop once the tree was gone"
    assert not t.failures and t.done == [True], t.failures


@needs_uffd
def test_hundreds_of_forked_children_never_block_the_daemon(tree):
    """Each forked child's uffd is parked for the watchdog. A blocking send per uffd, drained only at
    the end, filled the socket after about 278 forks: the daemon blocked for ever, and the tree with
    it (bash loops, subprocess with preexec_fn, multiprocessing)."""
    t = tree()
    assert t.step("read 0 4096") == _image(0, 4096)
    assert t.step("forks 600", 60) == "ok"
    assert t.step(f"fork-read {4 * MiB} {MiB}") == _image(4 * MiB, MiB)
    assert t.step("finish") == "ok"
    assert t.ended.wait(30) and t.done == [True], t.failures
    assert t.step(f"read 0 {_SIZE}") == _image(0, _SIZE)


@needs_uffd
def test_a_forked_child_gets_zeros_where_the_image_says_wipe_on_fork_and_no_pages_where_dont_fork(tree):
    """kernel/fork.c registers every VMA of the child with its uffd but copies no pages of a
    MADV_WIPEONFORK one (an RNG's state: OpenSSL, BoringSSL) and leaves out MADV_DONTFORK ones.
    Handing the child the parent's missing pages there gave it the parent's secret state."""
    wipe, dont = 1 << 18, 1 << 10  # 1 << MADV_WIPEONFORK, 1 << MADV_DONTFORK, as CRIU records them
    t = tree(vmas=[(_ADDR, _ADDR + 4 * MiB), (_ADDR + 4 * MiB, _ADDR + 5 * MiB, wipe),
                   (_ADDR + 5 * MiB, _ADDR + 6 * MiB, dont), (_ADDR + 6 * MiB, _ADDR + _SIZE)])
    assert t.step(f"madvise {4 * MiB} {MiB} 18") == "ok"  # what the restorer does with the image's madv
    assert t.step(f"madvise {5 * MiB} {MiB} 10") == "ok"
    assert t.step(f"fork-read {4 * MiB} {MiB}") == _sha(bytes(MiB)), "the child read the parent's pages"
    assert t.step(f"fork-read {3 * MiB} {MiB}") == _image(3 * MiB, MiB)
    assert t.step(f"read {4 * MiB} {2 * MiB}") == _image(4 * MiB, 2 * MiB)  # the parent's own are its image
    assert t.step("finish") == "ok"
    assert t.ended.wait(20) and t.done == [True], t.failures
    assert t.server.unmapped_bytes == 0  # no DONTFORK page was tried in a child


def test_fds_criu_sends_are_received_close_on_exec():
    """A userfaultfd received by the page server must not reach a program started meanwhile (CPython
    3.11's socket.recv_fds drops MSG_CMSG_CLOEXEC)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        socket.send_fds(a, [b"x"], [r, w])
        got = recv_fds(b, 4)
        assert len(got) == 2 and all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in got)
        for fd in got:
            os.close(fd)
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()

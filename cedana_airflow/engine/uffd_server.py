"""Our own lazy-pages daemon: the restored tree's page faults answered with fault-around.

``criu restore --lazy-pages`` hands each restored process's userfaultfd to whoever listens on
``lazy-pages.socket`` in its work dir (criu/uffd.c: a stream socket; per task, ``int pid`` and then
the fd in an SCM_RIGHTS message with one dummy byte; a negative pid, a zombie, comes without one;
the u32 ``RESTORE_FINISHED`` once the restore is done). CRIU's own daemon answers each fault with
one page and follows it with a 64 KiB background copy, so a process that touches 20 MB after
resuming waits for 5,000 round trips (bench/README.md, "Where a restore's time goes"). Here a fault
is answered with the whole aligned window around it (:data:`FAULT_AROUND_BYTES`, within its lazy
run and its VMA), and the background copies :data:`BACKGROUND_BYTES` at a time, only while no fault
waits.

What the kernel reports besides faults (the events CRIU asks for, ``uffd-noncoop``) is followed as
CRIU follows it: FORK gives a child's uffd, whose missing pages are the parent's at that moment;
REMAP moves pages to a new address; REMOVE (``madvise(DONTNEED)``) and UNMAP drop them (a later
fault there is the kernel's zero page, never old data). While one of those is in flight the kernel
refuses copies (EAGAIN): the fault is kept and tried again once the event is read.

The rule of every lazy path holds: no byte reaches the process unverified (``pages`` reads
verified chunks) and the process never runs on a page it did not get. Each uffd is also parked in
a socket whose other end :attr:`UffdServer.holds` gives the workload's watchdog: if this process
dies, the uffds stay open there, the tree's faults stay blocked, and the watchdog kills the tree.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .images import image_messages, message_values
from .pagemap import PAGE_SIZE, Pagemap

__all__ = ["BACKGROUND_BYTES", "FAULT_AROUND_BYTES", "SOCKET_NAME", "UffdServer", "lazy_iovs", "read_vmas"]

log = logging.getLogger(__name__)

SOCKET_NAME = "lazy-pages.socket"
_RESTORE_FINISHED = 0x52535446  # "ReSTore Finished" (criu/uffd.c)
#: A fault is answered with the aligned window of this size around it (one chunk's worth: the chunk
#: is fetched and verified for the faulting page anyway).
FAULT_AROUND_BYTES = 1 << 20
#: What the background copies at a time at most, between looks at the fault queue (CRIU's maximum).
#: It starts at a fault's window after each fault and doubles while none comes: a fault that arrives
#: during a copy waits for it, so copies stay short while the process is faulting.
BACKGROUND_BYTES = 4 << 20
#: ENOENT (no VMA there) while its REMAP or UNMAP event is on its way is retried; this many in a row
#: (about a second of looking again every millisecond) and the range is taken as gone.
_STALLED_MAX = 1000

# linux/userfaultfd.h
_EVENT_PAGEFAULT, _EVENT_FORK, _EVENT_REMAP, _EVENT_REMOVE, _EVENT_UNMAP = 0x12, 0x13, 0x14, 0x15, 0x16
_MSG = struct.Struct("=B3x4x24s")  # struct uffd_msg: event, reserved, then the 24-byte union
_UFFDIO_UNREGISTER = 0x8010AA01  # _IOR(0xAA, 0x01, struct uffdio_range)
_UFFDIO_WAKE = 0x8010AA02  # _IOR(0xAA, 0x02, struct uffdio_range)
_UFFDIO_COPY = 0xC028AA03  # _IOWR(0xAA, 0x03, struct uffdio_copy)
_UFFDIO_ZEROPAGE = 0xC020AA04  # _IOWR(0xAA, 0x04, struct uffdio_zeropage)


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class _Zero(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("zeropage", ctypes.c_int64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_libc.ioctl.restype = ctypes.c_int


def _ioctl(fd: int, request: int, arg: ctypes.Structure) -> int:
    """0, or the errno of a failed ioctl (``arg`` holds what the kernel wrote back either way)."""
    return 0 if _libc.ioctl(fd, request, ctypes.addressof(arg)) == 0 else ctypes.get_errno()


#: (pid in the image, address in the image, pages) -> those pages, in pieces, all verified.
PageSource = Callable[[int, int, int], Sequence[bytes | memoryview]]


def read_vmas(image_dir: Path, pid: int) -> list[tuple[int, int]]:
    """The (start, end) of each VMA of process ``pid`` (``mm-<pid>.img``; mm.proto field 14, a
    repeated message: read with :func:`message_values`, which keeps every value)."""
    entries = image_messages(image_dir / f"mm-{pid}.img")
    if not entries:
        raise ValueError(f"mm-{pid}.img holds no entry")
    out = []
    for v in message_values(entries[0]).get(14, []):
        f = message_values(v) if isinstance(v, bytes) else {}
        start, end = f.get(1, [None])[0], f.get(2, [None])[0]
        if not isinstance(start, int) or not isinstance(end, int) or end <= start:
            raise ValueError(f"mm-{pid}.img has a malformed VMA")
        out.append((start, end))
    return sorted(out)


def lazy_iovs(pagemap: Pagemap, vmas: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The lazy runs as ``[start, end, image address]``, split at VMA ends (a copy may not cross one)."""
    out: list[list[int]] = []
    ends = [e for _, e in vmas]
    for run in pagemap.runs:
        if not run.lazy:
            continue
        start = run.vaddr
        while start < run.end:
            i = bisect.bisect_right(ends, start)
            end = min(run.end, ends[i]) if i < len(ends) else run.end
            out.append([start, end, start])
            start = end
    return out


class _Task:
    """One restored address space: its uffd and the lazy pages it has not got yet."""

    def __init__(self, pid: int, fd: int, iovs: list[list[int]]) -> None:
        self.pid, self.fd, self.iovs = pid, fd, iovs  # iovs: sorted, disjoint [start, end, image address]
        self.waiting: list[int] = []  # faulting addresses a copy could not serve yet (EAGAIN)
        self.xfer = FAULT_AROUND_BYTES  # the next background copy's size
        self.stalled = 0  # copies refused in a row as unmapped (ENOENT) with no event to explain it

    def find(self, addr: int) -> int:
        """Index of the iov holding ``addr``, or -1."""
        i = bisect.bisect_right(self.iovs, [addr, float("inf")]) - 1
        return i if i >= 0 and self.iovs[i][0] <= addr < self.iovs[i][1] else -1

    def take(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Remove [start, end) from the iovs; the (start, end, image address) pieces it held."""
        iovs = self.iovs
        i = bisect.bisect_right(iovs, [start, float("inf")]) - 1
        if i < 0 or iovs[i][1] <= start:
            i += 1
        j, got, keep = i, [], []
        while j < len(iovs) and iovs[j][0] < end:  # sorted and disjoint: only these can overlap
            s, e, img = iovs[j]
            lo, hi = max(s, start), min(e, end)
            got.append((lo, hi, img + (lo - s)))
            if s < lo:
                keep.append([s, lo, img])
            if hi < e:
                keep.append([hi, e, img + (hi - s)])
            j += 1
        iovs[i:j] = keep
        return got

    def remap(self, frm: int, to: int, length: int) -> None:
        moved = self.take(frm, frm + length)
        for s, e, img in moved:
            self.iovs.append([s - frm + to, e - frm + to, img])
        self.iovs.sort()


class UffdServer(threading.Thread):
    """Serves the uffds ``criu restore --lazy-pages`` sends to ``image_dir``/lazy-pages.socket.

    :meth:`listen` before ``criu restore``; then pages come from ``pages``; a failure of theirs goes to
    ``on_failure`` (which kills the tree) while the tree's faults stay blocked; ``on_done(ok)`` runs
    once every page is in (ok) or serving stopped; :meth:`release` lets go of every uffd."""

    def __init__(self, image_dir: Path, pagemaps: dict[int, Pagemap], pages: PageSource,
                 on_failure: Callable[[BaseException], None], on_done: Callable[[bool], None]) -> None:
        super().__init__(name="cedana-uffd", daemon=True)
        self.image_dir, self.pagemaps, self.pages = image_dir, pagemaps, pages
        self.on_failure, self.on_done = on_failure, on_done
        self.requests = 0  # faults reported (one tried again after an event counts once)
        self.served_bytes = 0
        self.busy_seconds = 0.0
        self.error: BaseException | None = None
        self._iovs: dict[int, list[list[int]]] = {}
        self._tasks: dict[int, _Task] = {}  # by uffd
        self._listen: socket.socket | None = None
        self._client: socket.socket | None = None
        self._finished = False  # the restore said it is done: the background may run
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop_lock = threading.Lock()
        self._park_keep, self._park = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._released = threading.Event()
        self._bounce = mmap.mmap(-1, BACKGROUND_BYTES)  # page-aligned: whole pages from several chunks
        self._bounce_ref: ctypes.c_char | None = ctypes.c_char.from_buffer(self._bounce)
        self._bounce_addr = ctypes.addressof(self._bounce_ref)
        self._ep = select.epoll()

    # -- before criu restore ------------------------------------------------------------------------
    def listen(self) -> None:
        """Read every process's lazy runs and listen where ``criu restore`` connects. OSError when
        the socket cannot be made; ValueError when an mm image is not one CRIU wrote."""
        for pid, pm in self.pagemaps.items():
            self._iovs[pid] = lazy_iovs(pm, read_vmas(self.image_dir, pid))
        (self.image_dir / SOCKET_NAME).unlink(missing_ok=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # CRIU connects to the name relative to its work dir, whose path may be longer than a socket
        # address holds (107 bytes): bind through the directory's fd instead
        dfd = os.open(self.image_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            s.bind(f"/proc/self/fd/{dfd}/{SOCKET_NAME}")
            s.listen(1)
        except BaseException:
            s.close()
            raise
        finally:
            os.close(dfd)
        self._listen = s
        self.start()

    @property
    def holds(self) -> tuple[int, ...]:
        """The fd the workload's watchdog keeps: every uffd is parked in it (see the module's doc)."""
        return (self._park_keep.fileno(),)

    # -- serving -------------------------------------------------------------------------------------
    def run(self) -> None:
        ok = False
        try:
            assert self._listen is not None
            self._ep.register(self._listen.fileno(), select.EPOLLIN)
            self._ep.register(self._stop_r, select.EPOLLIN)
            ok = self._serve()
        except BaseException as e:  # noqa: BLE001 - a page that cannot come: the tree must be killed
            if not self._released.is_set():  # (after a release, what broke off is no failure)
                self.error = e
                log.debug("lazy pages: serving stopped", exc_info=True)
                self.on_failure(e)
                self._released.wait()  # the tree is dead (on_failure killed it) or the caller let go
        finally:
            self._close_all()
            self.on_done(ok)

    def _serve(self) -> bool:
        """Until every page is in (True) or :meth:`release` (False)."""
        while True:
            if self._released.is_set():
                return False
            if self._finished and not any(t.iovs or t.waiting for t in self._tasks.values()):
                return True  # every page in, or every process gone
            busy = self._finished and any(t.iovs for t in self._tasks.values())
            waiting = any(t.waiting for t in self._tasks.values())  # an event to come first: look again soon
            events = self._ep.poll(0 if busy else 0.001 if waiting else -1)
            for fd, ev in events:
                if fd == self._stop_r:
                    return False
                if self._listen is not None and fd == self._listen.fileno():
                    self._accept()
                elif self._client is not None and fd == self._client.fileno():
                    self._from_restore()
                elif fd in self._tasks:
                    self._events(self._tasks[fd], ev)
            for t in list(self._tasks.values()):
                if t.waiting:
                    self._retry(t)
            if not events and busy:
                self._background()

    def _accept(self) -> None:
        assert self._listen is not None
        client, _ = self._listen.accept()
        self._ep.unregister(self._listen.fileno())
        self._listen.close()
        self._listen = None
        self._client = client
        self._ep.register(client.fileno(), select.EPOLLIN)

    def _from_restore(self) -> None:
        """One message of criu restore's: a task's pid and uffd, a zombie, or the end of the restore."""
        assert self._client is not None
        head = self._client.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:  # the restore ended (its socket closed): nothing more comes this way
            self._ep.unregister(self._client.fileno())
            self._client.close()
            self._client = None
            if not self._finished:
                raise OSError("criu restore closed the lazy-pages socket before it finished")
            return
        (pid,) = struct.unpack("=i", head)
        if pid == _RESTORE_FINISHED:
            self._finished = True
            return
        if pid < 0:  # a zombie: no memory, no uffd
            return
        _, fds, _, _ = socket.recv_fds(self._client, 1, 1, socket.MSG_CMSG_CLOEXEC)
        if len(fds) != 1:
            raise OSError(f"criu restore sent pid {pid} without its userfaultfd")
        iovs = self._iovs.get(pid)
        if iovs is None:
            raise ValueError(f"criu restore sent pid {pid}, which has no pagemap in this checkpoint")
        self._add(_Task(pid, fds[0], [list(i) for i in iovs]))

    def _add(self, task: _Task) -> None:
        socket.send_fds(self._park, [b"\0"], [task.fd])  # kept open by the watchdog too
        self._tasks[task.fd] = task
        self._ep.register(task.fd, select.EPOLLIN)

    def _drop(self, task: _Task) -> None:
        """The process is gone (its uffd hung up) or its pages no longer matter."""
        self._tasks.pop(task.fd, None)
        with contextlib.suppress(OSError):
            self._ep.unregister(task.fd)
        with contextlib.suppress(OSError):
            os.close(task.fd)

    def _events(self, task: _Task, ev: int) -> None:
        while task.fd in self._tasks:
            try:
                raw = os.read(task.fd, _MSG.size * 64)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno in (errno.EBADF, errno.ENODEV):
                    self._drop(task)
                    return
                raise
            if not raw:
                self._drop(task)
                return
            for off in range(0, len(raw) - _MSG.size + 1, _MSG.size):
                event, arg = _MSG.unpack_from(raw, off)
                self._event(task, event, arg)
        if ev & (select.EPOLLHUP | select.EPOLLERR) and task.fd in self._tasks:
            self._drop(task)

    def _event(self, task: _Task, event: int, arg: bytes) -> None:
        if event == _EVENT_PAGEFAULT:
            _, addr = struct.unpack_from("=QQ", arg)
            self.requests += 1
            self._fault(task, addr & ~(PAGE_SIZE - 1))
        elif event == _EVENT_FORK:
            (ufd,) = struct.unpack_from("=I", arg)
            self._add(_Task(task.pid, ufd, [list(i) for i in task.iovs]))
        elif event == _EVENT_REMAP:
            frm, to, length = struct.unpack_from("=QQQ", arg)
            task.remap(frm, to, length)
        elif event in (_EVENT_REMOVE, _EVENT_UNMAP):
            start, end = struct.unpack_from("=QQ", arg)
            if event == _EVENT_REMOVE:  # the VMA stays: its faults there are the kernel's zero pages from now on
                err = _ioctl(task.fd, _UFFDIO_UNREGISTER, _Range(start, end - start))
                if err == errno.ENOMEM:  # the process has gone
                    self._drop(task)
                    return
                if err:
                    raise OSError(err, f"UFFDIO_UNREGISTER {start:#x}-{end:#x}: {os.strerror(err)}")
            task.take(start, end)
        else:
            raise OSError(f"unexpected userfaultfd event {event:#x}")

    # -- copying -------------------------------------------------------------------------------------
    def _fault(self, task: _Task, addr: int) -> None:
        t0 = time.perf_counter()
        i = task.find(addr)
        if i < 0:  # not a lazy page: never dumped (zero), or already in (then the kernel says EEXIST)
            err = _ioctl(task.fd, _UFFDIO_ZEROPAGE, _Zero(_Range(addr, PAGE_SIZE), 0, 0))
            if err == errno.EAGAIN:
                task.waiting.append(addr)
            elif err not in (0, errno.EEXIST, errno.ENOENT, errno.ESRCH, errno.ENOSPC):
                raise OSError(err, f"UFFDIO_ZEROPAGE {addr:#x}: {os.strerror(err)}")
            elif err == errno.EEXIST:
                _ioctl(task.fd, _UFFDIO_WAKE, _Range(addr, PAGE_SIZE))
            return
        task.xfer = FAULT_AROUND_BYTES
        s, e, _ = task.iovs[i]
        lo = max(s, addr - addr % FAULT_AROUND_BYTES)
        hi = min(e, lo + FAULT_AROUND_BYTES)
        if not self._copy(task, lo, hi):
            task.waiting.append(addr)
        self.busy_seconds += time.perf_counter() - t0

    def _retry(self, task: _Task) -> None:
        waiting, task.waiting = task.waiting, []
        for addr in waiting:
            if task.fd in self._tasks:
                self._fault(task, addr)

    def _background(self) -> None:
        task = next(t for t in self._tasks.values() if t.iovs)
        s, e, _ = task.iovs[0]
        t0 = time.perf_counter()
        self._copy(task, s, min(e, s + task.xfer))
        task.xfer = min(2 * task.xfer, BACKGROUND_BYTES)
        self.busy_seconds += time.perf_counter() - t0

    def _copy(self, task: _Task, start: int, end: int) -> bool:
        """Copy [start, end) of the task's lazy pages in; False when the kernel said not now (EAGAIN:
        an event is in flight), and the pages stay to be copied."""
        for lo, hi, img in task.take(start, end):
            n = hi - lo
            pos = 0
            for piece in self.pages(task.pid, img, n // PAGE_SIZE):
                self._bounce[pos : pos + len(piece)] = piece
                pos += len(piece)
            if pos != n:
                raise ValueError(f"pages of pid {task.pid} at {img:#x}: {pos} bytes where {n} were asked")
            done = 0
            while done < n:
                arg = _Copy(lo + done, self._bounce_addr + done, n - done, 0, 0)
                err = _ioctl(task.fd, _UFFDIO_COPY, arg)
                if err == 0:
                    done = n
                elif arg.copy > 0:  # part of it (the kernel says EAGAIN then): go on from there
                    done += arg.copy
                elif err == errno.EEXIST:  # that page is in already: skip it
                    done += PAGE_SIZE
                elif err in (errno.EAGAIN, errno.ENOENT):  # an event is in flight: put the rest back
                    task.stalled = task.stalled + 1 if err == errno.ENOENT else 0
                    if task.stalled > _STALLED_MAX:  # no event came to explain it: that memory is gone
                        log.warning("lazy pages of pid %d at %#x: no longer mapped, dropped", task.pid, lo + done)
                        break
                    bisect.insort(task.iovs, [lo + done, hi, img + done])
                    self.served_bytes += done
                    return False
                elif err in (errno.ESRCH, errno.ENOSPC):  # the process has gone
                    self._drop(task)
                    return True
                else:
                    raise OSError(err, f"UFFDIO_COPY {lo + done:#x}+{n - done}: {os.strerror(err)}")
            self.served_bytes += done
        return True

    # -- the end ---------------------------------------------------------------------------------------
    def release(self) -> None:
        """Stop serving and let go of every uffd (the tree is dead, or has every page)."""
        with self._stop_lock:
            self._released.set()
            if self._stop_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._stop_w, b"x")

    def _close_all(self) -> None:
        for t in list(self._tasks.values()):
            self._drop(t)
        for s in (self._listen, self._client):
            if s is not None:
                s.close()
        # drain what was parked, so no uffd outlives the serving (the watchdog's copy ends with it)
        self._park_keep.setblocking(False)
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(self._park_keep, 1, 16)
            except BlockingIOError:
                break
            for fd in fds:
                os.close(fd)
        self._ep.close()
        (self.image_dir / SOCKET_NAME).unlink(missing_ok=True)

    def close(self) -> None:
        """Release, wait for the thread, and free what is left."""
        self.release()
        if self.is_alive():
            self.join(10)
        with self._stop_lock:
            for fd in (self._stop_r, self._stop_w):
                os.close(fd)
            self._stop_r = self._stop_w = -1
        if not self._ep.closed:  # never served (listen failed)
            self._ep.close()
        self._park.close()
        self._park_keep.close()
        self._bounce_ref = None  # the mapping cannot close while a pointer into it exists
        self._bounce.close()

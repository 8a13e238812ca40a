"""Our own lazy-pages daemon: the restored tree's page faults answered with fault-around.

``criu restore --lazy-pages`` hands each restored process's userfaultfd to whoever listens on
``lazy-pages.socket`` in its work dir (criu/uffd.c: a stream socket; per task, ``int pid`` and then
the fd in an SCM_RIGHTS message with one dummy byte; a negative pid, a zombie, comes without one;
the u32 ``RESTORE_FINISHED`` once the restore is done). CRIU's own daemon answers each fault with
one page and follows it with a 64 KiB background copy, so a process that touches 20 MB after
resuming waits for 5,000 round trips (bench/README.md, "Where a restore's time goes"). Here a fault
is answered with the aligned window around it (:data:`FAULT_AROUND_BYTES`, within its lazy run),
and the background copies :data:`BACKGROUND_BYTES` at a time, only while no fault waits.

What the kernel reports besides faults (the events CRIU asks for, ``uffd-noncoop``) is followed as
CRIU follows it: FORK gives a child's uffd, whose missing pages are the parent's at that moment;
REMAP moves pages to a new address; REMOVE (``madvise(DONTNEED)``) and UNMAP drop them (a later
fault there is the kernel's zero page, never old data).

The invariants, each kept by one rule below (Documentation/admin-guide/mm/userfaultfd.rst and
mm/userfaultfd.c are the reference):

- **Events are applied before any fault read with them.** ``read()`` returns pending faults before
  events, and reading an event lets the process go on (the kernel stops refusing copies for it), so
  a batch's faults are served only after its FORK/REMAP/REMOVE/UNMAP changed the bookkeeping. An
  event not read yet makes a copy fail with EAGAIN (``mmap_changing``): the fault waits for it.
- **A faulting address is answered with the image's bytes, or the tree is killed.** A copy fails
  with ENOENT when it crosses a VMA end the process made after the restore (``mprotect``, ``mlock``,
  ``madvise`` on part of a region give no event): it is retried shorter, down to single pages. A
  single page refused twice has no registered VMA (the first refusal may race an mremap whose event
  is not raised yet; see :meth:`UffdServer._copy_piece`): skipped when the background meets it, a
  failure when a fault waits on it.
- **A forked child gets the parent's missing pages, except where it gets none**: ``MADV_DONTFORK``
  regions (not in the child) and ``MADV_WIPEONFORK`` ones (zeros in the child: an RNG's state, say)
  as the image records them (``madv`` of each VMA; kernel/fork.c, dup_mmap). Set after the restore,
  they are not seen (the daemon does not know the child's pid to read its smaps).
- **Nothing waits for ever**: a fault the kernel keeps refusing with EAGAIN for
  :data:`_EAGAIN_MAX_SECONDS` while no event comes (a kernel that leaks ``mmap_changing`` after a
  failed mremap) is a failure, not a hang.
- **A range is never dropped while mapped**: only an UNMAP, a REMOVE, a REMAP's old place or a
  single page the kernel says is not there leaves the bookkeeping without a copy.
- **A park never blocks**: each uffd is also parked in a socket whose other end :attr:`UffdServer.holds`
  gives the workload's watchdog (if this process dies, the uffds stay open there, the tree's faults
  stay blocked, and the watchdog kills the tree). The socket never blocks; when its queue grows,
  it is emptied and only the uffds still serving are parked again, many to a message.

A process that exits is seen as ESRCH (or ENOMEM from UNREGISTER): it is marked gone and the rest
of its batch skips it; its fd is closed only after the batch (a FORK read in the same batch may be
given a reused number otherwise). No byte reaches the process unverified (``pages`` reads verified chunks).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, overload

from .images import image_messages, message_values
from .pagemap import PAGE_SIZE, Pagemap

__all__ = ["BACKGROUND_BYTES", "FAULT_AROUND_BYTES", "LazyPagesError", "SOCKET_NAME", "UffdServer", "lazy_iovs",
           "read_vmas"]

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
#: A fault refused with EAGAIN this long while no event came is a failure (see the module's doc).
_EAGAIN_MAX_SECONDS = 30.0
#: madvise advice a forked child does not inherit the pages of (mm/madvise.c; CRIU's VMA ``madv`` bits).
_MADV_DONTFORK, _MADV_WIPEONFORK = 10, 18
#: Messages read from one uffd at a time (each 32 bytes).
_BATCH = 64
#: Parked messages before the park is emptied and the live uffds parked again, up to _SCM_MAX_FD a message.
_PARK_COMPACT_AT = 64
_SCM_MAX_FD = 253  # include/net/scm.h
_PARK_SNDBUF = 4 << 20

# linux/userfaultfd.h
_EVENT_PAGEFAULT, _EVENT_FORK, _EVENT_REMAP, _EVENT_REMOVE, _EVENT_UNMAP = 0x12, 0x13, 0x14, 0x15, 0x16
_MSG = struct.Struct("=B3x4x24s")  # struct uffd_msg: event, reserved, then the 24-byte union
_UFFDIO_UNREGISTER = 0x8010AA01  # _IOR(0xAA, 0x01, struct uffdio_range)
_UFFDIO_WAKE = 0x8010AA02  # _IOR(0xAA, 0x02, struct uffdio_range)
_UFFDIO_COPY = 0xC028AA03  # _IOWR(0xAA, 0x03, struct uffdio_copy)
_UFFDIO_ZEROPAGE = 0xC020AA04  # _IOWR(0xAA, 0x04, struct uffdio_zeropage)
_GONE = (errno.ESRCH, errno.ENOSPC)  # the process's mm has gone (ENOSPC before Linux 4.14)


class LazyPagesError(RuntimeError):
    """The daemon cannot keep its invariants for this tree (our failure, not the checkpoint's)."""


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
#: (pid in the image, address in the image, pages): those pages are in (or gone); their chunks may go.
PagesDone = Callable[[int, int, int], None]


@overload
def read_vmas(image_dir: Path, pid: int) -> list[tuple[int, int]]: ...
@overload
def read_vmas(image_dir: Path, pid: int, *, with_madv: Literal[True]) -> list[tuple[int, int, int]]: ...


def read_vmas(image_dir: Path, pid: int, *, with_madv: bool = False) -> list[tuple[int, int]] | list[tuple[int, int, int]]:
    """The (start, end) of each VMA of process ``pid`` (``mm-<pid>.img``; mm.proto field 14, a
    repeated message: read with :func:`message_values`, which keeps every value); ``with_madv``: and
    its madvise bits (vma.proto field 9, ``1 << MADV_x``; 0 when absent)."""
    entries = image_messages(image_dir / f"mm-{pid}.img")
    if not entries:
        raise ValueError(f"mm-{pid}.img holds no entry")
    out: list[tuple[int, int, int]] = []
    for v in message_values(entries[0]).get(14, []):
        f = message_values(v) if isinstance(v, bytes) else {}
        start, end = f.get(1, [None])[0], f.get(2, [None])[0]
        madv = f.get(9, [0])[0]
        if not isinstance(start, int) or not isinstance(end, int) or end <= start or not isinstance(madv, int):
            raise ValueError(f"mm-{pid}.img has a malformed VMA")
        out.append((start, end, madv))
    return sorted(out) if with_madv else sorted((s, e) for s, e, _ in out)


def lazy_iovs(pagemap: Pagemap, vmas: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The lazy runs as ``[start, end, image address]``, split at the image's VMA ends (a copy may
    not cross one; ends made after the restore are found by the copies themselves)."""
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
        self.waiting: list[int] = []  # faulting addresses a copy could not serve yet (EAGAIN: an event to read)
        self.waiting_since: float | None = None  # when the oldest of them was first refused
        self.xfer = FAULT_AROUND_BYTES  # the next background copy's size
        self.gone = False  # its process has exited: nothing more is copied into it

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

    def put_back(self, start: int, end: int, img: int) -> None:
        if start < end:
            bisect.insort(self.iovs, [start, end, img])

    def remap(self, frm: int, to: int, length: int) -> None:
        moved = self.take(frm, frm + length)
        for s, e, img in moved:
            self.iovs.append([s - frm + to, e - frm + to, img])
        self.iovs.sort()

    @property
    def done(self) -> bool:
        return self.gone or not self.iovs and not self.waiting


class UffdServer(threading.Thread):
    """Serves the uffds ``criu restore --lazy-pages`` sends to ``image_dir``/lazy-pages.socket.

    :meth:`listen` before ``criu restore``; then pages come from ``pages`` (``pages_done`` is told
    which are in, so their chunks can go); a failure of theirs or ours goes to ``on_failure`` (which
    kills the tree) while the tree's faults stay blocked; ``on_done(ok)`` runs once every page is in
    (ok) or serving stopped; :meth:`release` lets go of every uffd."""

    def __init__(self, image_dir: Path, pagemaps: dict[int, Pagemap], pages: PageSource,
                 on_failure: Callable[[BaseException], None], on_done: Callable[[bool], None],
                 pages_done: PagesDone | None = None) -> None:
        super().__init__(name="cedana-uffd", daemon=True)
        self.image_dir, self.pagemaps, self.pages, self.pages_done = image_dir, pagemaps, pages, pages_done
        self.on_failure, self.on_done = on_failure, on_done
        self.requests = 0  # faults reported (one tried again after an event counts once)
        self.served_bytes = 0
        self.unmapped_bytes = 0  # lazy pages the kernel said have no VMA any more (skipped, never dropped)
        self.busy_seconds = 0.0
        self.error: BaseException | None = None
        self._iovs: dict[int, list[list[int]]] = {}
        self._no_fork: dict[int, list[tuple[int, int]]] = {}  # image pid -> VMAs a forked child gets no pages of
        self._tasks: dict[int, _Task] = {}  # by uffd
        self._closing: list[_Task] = []  # gone or done: their fds close after the batch that found it
        self._listen: socket.socket | None = None
        self._client: socket.socket | None = None
        self._finished = False  # the restore said it is done: the background may run
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop_lock = threading.Lock()
        self._park_keep, self._park = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._park.setblocking(False)
        self._park_keep.setblocking(False)
        try:  # room for many parked messages (root may pass net.core.wmem_max)
            self._park.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_SNDBUFFORCE", 32), _PARK_SNDBUF)
        except OSError:
            with contextlib.suppress(OSError):
                self._park.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _PARK_SNDBUF)
        self._parked = 0  # messages in the park
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
            vmas = read_vmas(self.image_dir, pid, with_madv=True)
            self._iovs[pid] = lazy_iovs(pm, [(s, e) for s, e, _ in vmas])
            self._no_fork[pid] = [(s, e) for s, e, madv in vmas if madv & (1 << _MADV_DONTFORK | 1 << _MADV_WIPEONFORK)]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:  # a uffd per forked child: a fork storm must not run us out of fds
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
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
            if self._finished and all(t.done for t in self._tasks.values()):
                return True  # every page in, or every process gone
            busy = self._finished and any(t.iovs and not t.gone for t in self._tasks.values())
            waiting = any(t.waiting for t in self._tasks.values())  # an event to come first: look again soon
            events = self._ep.poll(0 if busy else 0.001 if waiting else -1)
            for fd, ev in events:
                if fd == self._stop_r:
                    return False
                if self._listen is not None and fd == self._listen.fileno():
                    self._accept()
                elif self._client is not None and fd == self._client.fileno():
                    self._from_restore()
                else:
                    task = self._tasks.get(fd)
                    if task is not None and not task.gone:
                        self._read(task, ev)
            for t in list(self._tasks.values()):
                if t.waiting and not t.gone:
                    self._retry(t)
            if not events and busy:
                self._background()
            self._settle()

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
        fds = recv_fds(self._client, 1)
        if len(fds) != 1:
            raise OSError(f"criu restore sent pid {pid} without its userfaultfd")
        iovs = self._iovs.get(pid)
        if iovs is None:
            os.close(fds[0])
            raise ValueError(f"criu restore sent pid {pid}, which has no pagemap in this checkpoint")
        self._add(_Task(pid, fds[0], [list(i) for i in iovs]))

    def _add(self, task: _Task) -> None:
        self._tasks[task.fd] = task
        self._ep.register(task.fd, select.EPOLLIN)
        if self._parked >= _PARK_COMPACT_AT:
            self._compact_park()  # (parks this one too)
        else:
            self._park_fds([task.fd])

    # -- the park --------------------------------------------------------------------------------------
    def _park_fds(self, fds: list[int]) -> None:
        """Park copies of these uffds (never blocking: see the module's doc)."""
        for at in range(0, len(fds), _SCM_MAX_FD):
            try:
                socket.send_fds(self._park, [b"\0"], fds[at : at + _SCM_MAX_FD])
            except BlockingIOError:
                raise LazyPagesError(f"cannot park {len(self._tasks)} userfaultfds for the watchdog "
                                     "(its socket is full)") from None
            self._parked += 1

    def _compact_park(self) -> None:
        """Empty the park (closing our copies of what it held) and park the live uffds again, many to a
        message. Between the two, this process still holds every live uffd itself."""
        self._drain_park()
        live = [t.fd for t in self._tasks.values() if not t.gone]
        self._parked = 0
        if live:
            self._park_fds(live)

    def _drain_park(self) -> None:
        while True:
            try:
                fds = recv_fds(self._park_keep, _SCM_MAX_FD)
            except BlockingIOError:
                break
            for fd in fds:
                os.close(fd)

    # -- one uffd's messages ---------------------------------------------------------------------------
    def _read(self, task: _Task, ev: int) -> None:
        """One read of the task's messages: its events applied first, then its faults served."""
        try:
            raw = os.read(task.fd, _MSG.size * _BATCH)
        except BlockingIOError:
            raw = None
        except OSError as e:
            if e.errno not in (errno.EBADF, errno.ENODEV):
                raise
            self._gone(task)
            return
        if raw is None:
            if ev & (select.EPOLLHUP | select.EPOLLERR):
                self._gone(task)
            return
        if not raw:
            self._gone(task)
            return
        msgs = [_MSG.unpack_from(raw, off) for off in range(0, len(raw) - _MSG.size + 1, _MSG.size)]
        faults = []
        for event, arg in msgs:
            if event == _EVENT_PAGEFAULT:
                faults.append(struct.unpack_from("=QQ", arg)[1] & ~(PAGE_SIZE - 1))
            else:
                self._event(task, event, arg)  # a FORK is followed even when its parent has gone since
                task.waiting_since = None  # an event came: what it held up may go now
        self.requests += len(faults)
        for addr in faults:
            if task.gone:
                break
            self._fault(task, addr)

    def _event(self, task: _Task, event: int, arg: bytes) -> None:
        if event == _EVENT_FORK:
            (ufd,) = struct.unpack_from("=I", arg)
            child = _Task(task.pid, ufd, [list(i) for i in task.iovs])
            for start, end in self._no_fork.get(task.pid, ()):
                child.take(start, end)  # not in the child (DONTFORK), or zeros there (WIPEONFORK)
            self._add(child)
        elif event == _EVENT_REMAP:
            frm, to, length = struct.unpack_from("=QQQ", arg)
            task.remap(frm, to, length)
        elif event in (_EVENT_REMOVE, _EVENT_UNMAP):
            start, end = struct.unpack_from("=QQ", arg)
            for lo, hi, img in task.take(start, end):
                self._done_pages(task, img, hi - lo)
            if event == _EVENT_REMOVE and not task.gone:
                # The VMA stays and its pages are zeros from now on: faults there go to the kernel. EINVAL:
                # no registered VMA is left in the range (the process unmapped it since; its UNMAP follows).
                err = _ioctl(task.fd, _UFFDIO_UNREGISTER, _Range(start, end - start))
                if err == errno.ENOMEM:  # the process has gone
                    self._gone(task)
                elif err not in (0, errno.EINVAL):
                    raise OSError(err, f"UFFDIO_UNREGISTER {start:#x}-{end:#x}: {os.strerror(err)}")
        else:
            raise LazyPagesError(f"unexpected userfaultfd event {event:#x}")

    # -- copying -------------------------------------------------------------------------------------
    def _fault(self, task: _Task, addr: int) -> None:
        t0 = time.perf_counter()
        i = task.find(addr)
        if i < 0:  # not a lazy page: never dumped (zero), dropped (zero), or already in
            self._zero(task, addr)
        else:
            task.xfer = FAULT_AROUND_BYTES
            s, e, _ = task.iovs[i]
            lo = max(s, addr - addr % FAULT_AROUND_BYTES)
            hi = min(e, lo + FAULT_AROUND_BYTES)
            if not self._copy(task, lo, hi, fault=addr):
                task.waiting.append(addr)
        self.busy_seconds += time.perf_counter() - t0

    def _zero(self, task: _Task, addr: int) -> None:
        err = _ioctl(task.fd, _UFFDIO_ZEROPAGE, _Zero(_Range(addr, PAGE_SIZE), 0, 0))
        if err == errno.EAGAIN:
            task.waiting.append(addr)
        elif err in _GONE:
            self._gone(task)
        elif err in (errno.EEXIST, errno.ENOENT):
            # in already (another thread's fault, or a copy), or no registered VMA any more (a REMOVE
            # unregistered it, an UNMAP took it): the faulting thread looks again and finds what is there
            _ioctl(task.fd, _UFFDIO_WAKE, _Range(addr, PAGE_SIZE))
        elif err:
            raise OSError(err, f"UFFDIO_ZEROPAGE {addr:#x}: {os.strerror(err)}")

    def _retry(self, task: _Task) -> None:
        now = time.monotonic()
        if task.waiting_since is None:
            task.waiting_since = now
        elif now - task.waiting_since > _EAGAIN_MAX_SECONDS:
            raise LazyPagesError(f"pid {task.pid}: the kernel refused copies (EAGAIN) for {_EAGAIN_MAX_SECONDS:.0f} s "
                                 f"with no event to read; faults at {', '.join(f'{a:#x}' for a in task.waiting[:3])} "
                                 "cannot be answered")
        waiting, task.waiting = task.waiting, []
        for addr in waiting:
            if not task.gone:
                self._fault(task, addr)
        if not task.waiting:
            task.waiting_since = None

    def _background(self) -> None:
        task = next(t for t in self._tasks.values() if t.iovs and not t.gone)
        s, e, _ = task.iovs[0]
        t0 = time.perf_counter()
        self._copy(task, s, min(e, s + task.xfer))
        task.xfer = min(2 * task.xfer, BACKGROUND_BYTES)
        self.busy_seconds += time.perf_counter() - t0

    def _copy(self, task: _Task, start: int, end: int, fault: int | None = None) -> bool:
        """Copy [start, end) of the task's lazy pages in; False when the kernel said not now (EAGAIN:
        an event is in flight), and what is left stays to be copied. ``fault``: the address a thread
        waits on, which must be answered (its page refused as unmapped is a failure)."""
        pieces = task.take(start, end)
        for k, (lo, hi, img) in enumerate(pieces):
            if task.gone or not self._copy_piece(task, lo, hi, img, fault):
                if not task.gone:
                    for lo2, hi2, img2 in pieces[k + 1 :]:
                        task.put_back(lo2, hi2, img2)
                return task.gone
        return True

    def _copy_piece(self, task: _Task, lo: int, hi: int, img: int, fault: int | None) -> bool:
        """One piece of :meth:`_copy`. A single page refused as unmapped (ENOENT) is asked once more
        before it is believed: a copy looks the VMA up before it checks ``mmap_changing``, so one that
        waited for an mremap finds the old place gone before the REMAP's ``mmap_changing`` is seen
        (mm/userfaultfd.c, mfill_atomic; mm/mremap.c raises it after moving the page tables). Asked
        again, it says EAGAIN; a second ENOENT comes with nothing in flight."""
        n = hi - lo
        pos = 0
        for piece in self.pages(task.pid, img, n // PAGE_SIZE):
            if pos + len(piece) > n:
                raise LazyPagesError(f"pages of pid {task.pid} at {img:#x}: more bytes than the {n} asked")
            self._bounce[pos : pos + len(piece)] = piece
            pos += len(piece)
        if pos != n:
            raise LazyPagesError(f"pages of pid {task.pid} at {img:#x}: {pos} bytes where {n} were asked")
        done = 0
        span = n  # what the next copy tries: halved while it crosses a VMA end made after the restore
        refused = False  # this page was refused once (ENOENT)
        while done < n:
            span = min(span, n - done)
            at = lo + done
            arg = _Copy(at, self._bounce_addr + done, span, 0, 0)
            err = _ioctl(task.fd, _UFFDIO_COPY, arg)
            if err == 0 or arg.copy > 0:  # all, or part of it (the kernel says EAGAIN then): go on from there
                refused = False
                got = span if err == 0 else arg.copy
                self.served_bytes += got
                done += got
                span *= 2
            elif err == errno.EEXIST:  # that page is in already: skip it
                if fault is not None and at <= fault < at + PAGE_SIZE:
                    _ioctl(task.fd, _UFFDIO_WAKE, _Range(fault, PAGE_SIZE))
                done += PAGE_SIZE
            elif err == errno.EAGAIN:  # an event is in flight: put the rest back, to copy once it is read
                task.put_back(at, hi, img + done)
                self._done_pages(task, img, done)
                return False
            elif err in _GONE:
                self._gone(task)
                self._done_pages(task, img, n)
                return False
            elif err == errno.ENOENT and span > PAGE_SIZE:  # crosses a VMA end: try shorter
                span = (span // 2) & ~(PAGE_SIZE - 1)
            elif err == errno.ENOENT and not refused:  # one page: ask once more (see the doc above)
                refused = True
            elif err == errno.ENOENT:  # twice: no VMA registered there, and no event in flight
                if fault is not None and at <= fault < at + PAGE_SIZE:
                    raise LazyPagesError(f"pid {task.pid} faulted at {fault:#x}, where the kernel now says no "
                                         "VMA is registered and no event says why")
                self.unmapped_bytes += PAGE_SIZE
                done += PAGE_SIZE
                refused = False
            else:
                raise OSError(err, f"UFFDIO_COPY {at:#x}+{span}: {os.strerror(err)}")
        self._done_pages(task, img, n)
        return True

    def _done_pages(self, task: _Task, img: int, n: int) -> None:
        if self.pages_done is not None and n >= PAGE_SIZE:
            self.pages_done(task.pid, img, n // PAGE_SIZE)

    # -- tasks that end --------------------------------------------------------------------------------
    def _gone(self, task: _Task) -> None:
        """The process has exited: nothing more is copied into it; its fd closes after the batch (its
        iovs stay until then: a FORK read in the same batch copies them)."""
        if not task.gone:
            task.gone = True
            task.waiting.clear()
            self._closing.append(task)

    def _settle(self) -> None:
        """Close the uffds of processes that have gone."""
        closing, self._closing = self._closing, []
        for t in closing:
            t.iovs.clear()
            self._close(t)

    def _close(self, task: _Task) -> None:
        if self._tasks.get(task.fd) is task:
            del self._tasks[task.fd]
        with contextlib.suppress(OSError):
            self._ep.unregister(task.fd)
        with contextlib.suppress(OSError):
            os.close(task.fd)

    # -- the end ---------------------------------------------------------------------------------------
    def release(self) -> None:
        """Stop serving and let go of every uffd (the tree is dead, or has every page)."""
        with self._stop_lock:
            self._released.set()
            if self._stop_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._stop_w, b"x")

    def _close_all(self) -> None:
        for t in {id(t): t for t in [*self._tasks.values(), *self._closing]}.values():  # each fd once
            self._close(t)
        self._closing = []
        for s in (self._listen, self._client):
            if s is not None:
                s.close()
        self._drain_park()  # so no uffd outlives the serving (the watchdog's copy ends with it)
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


def recv_fds(sock: socket.socket, max_fds: int) -> list[int]:
    """One byte's packet and the fds that came with it, close-on-exec: ``socket.recv_fds`` drops its
    flags (CPython 3.11), so a userfaultfd received with it would reach every program started meanwhile."""
    _, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(max_fds * 4), socket.MSG_CMSG_CLOEXEC)
    return [fd for level, kind, raw in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in struct.unpack(f"{len(raw) // 4}i", raw[: len(raw) - len(raw) % 4])]

"""A read-only file whose bytes come from a callback, mounted over /dev/fuse: a pages image that
fills itself on demand, for CRIU's lazy-pages daemon in its plain local mode.

Why a file and not (only) CRIU's page-server protocol (page_server.py): the daemon reads a local
pages image with plain ``pread``, so the kernel's page cache and readahead stand between a page
fault and us: a fault in memory the process walks through brings the next pages in with it, and
the daemon never busy-waits on a socket (it does with a page server, taking a core from the
fetch). Measured on the 2-core bench machine, see the note of issue 16.

Only the few FUSE requests a single read-only file needs are answered (INIT, GETATTR, OPEN, READ,
RELEASE, FLUSH, DESTROY; FORGET and INTERRUPT need no answer); anything else gets ENOSYS. The file
is mounted over an existing empty file in the supervisor's mount namespace and unmounted on
:meth:`close`; a supervisor killed before that leaves a dead mount that :func:`sweep` removes.

When the callback fails, the read is not answered until :meth:`release`: the daemon (the file's
only reader) stays blocked, so the process it feeds stays blocked on its fault until its
supervisor has killed it. An error answer first would let the daemon give up, and the kernel would
then hand the process zero-filled pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .iov import within_iov_max

__all__ = ["FSTYPE", "PageFile", "fuse_available", "sweep"]

FSTYPE = "fuse.cedana-pages"
_IN = struct.Struct("=IIQQIIIHH")  # fuse_in_header
_OUT = struct.Struct("=IiQ")  # fuse_out_header
_INIT_IN = struct.Struct("=IIII")
_INIT_OUT = struct.Struct("=IIIIHHIIHHI7I")  # protocol 7.28+, 64 bytes
_ATTR_OUT = struct.Struct("=QII" + "Q" * 6 + "I" * 10)
_OPEN_OUT = struct.Struct("=QII")
_READ_IN = struct.Struct("=QQIIQII")
_FORGET, _GETATTR, _OPEN, _READ, _RELEASE, _FLUSH, _INIT = 2, 3, 14, 15, 18, 25, 26
_INTERRUPT, _DESTROY, _BATCH_FORGET = 36, 38, 42
_FUSE_ASYNC_READ, _FUSE_MAX_PAGES = 1, 1 << 22
_FOPEN_KEEP_CACHE = 1 << 1
_MAX_READ = 1 << 20
_NOTIFY_STORE = 4  # fuse_notify_code: put data into the file's page cache, unasked
_STORE_OUT = struct.Struct("=QQII")  # fuse_notify_store_out: nodeid, offset, size, padding
_ROOT_ID = 1  # the mounted file is the filesystem's root inode
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_MNT_DETACH = 2

#: (offset, size) -> the bytes, in pieces (written as they are).
ReadSource = Callable[[int, int], Sequence[bytes | memoryview]]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def fuse_available() -> tuple[bool, str]:
    """Whether this node can serve a file over FUSE (the device, and root to mount)."""
    if os.geteuid() != 0:
        return False, "mounting needs root"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as e:
        return False, f"/dev/fuse: {e.strerror}"
    return True, "/dev/fuse"


def sweep(root: Path) -> int:
    """Unmount what a killed supervisor left of its page files under ``root``; how many. A page file
    under a restore folder of a process that still runs (``restore-<pid>-...``: another run of a node
    agent, which runs many in one process, or another supervisor sharing the work dir) is not touched."""
    gone = 0
    for line in _mountinfo():
        head, _, tail = line.partition(" - ")
        fields = head.split()
        if len(fields) > 4 and tail.split()[:1] == [FSTYPE]:
            target = fields[4].replace("\\040", " ")
            if target == str(root) or target.startswith(str(root).rstrip("/") + "/"):
                if _owner_runs(target[len(str(root)):]):
                    continue
                if _libc().umount2(target.encode(), _MNT_DETACH) == 0:
                    gone += 1
    return gone


def _owner_runs(relative: str) -> bool:
    """Whether the process a restore folder is named for (checkpointer.py: ``restore-<pid>-<tag>-...``)
    still runs."""
    m = re.search(r"(?:^|/)restore-(\d+)-", relative)
    if m is None:
        return False
    try:
        os.kill(int(m[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _widen_readahead(target: Path) -> None:
    """Let the kernel read ahead up to ``_MAX_READ`` on this mount (the INIT reply's max_readahead
    is only a cap: the mount's bdi starts at 128 KiB). A fault that misses then brings in 1 MiB
    around it instead of 128 KiB: on 1 GB, 8x fewer requests, and every page in 15-20% sooner
    (bench/README.md). Best effort: without it reads are smaller, not wrong."""
    for line in _mountinfo():
        fields = line.partition(" - ")[0].split()
        if len(fields) > 4 and fields[4].replace("\\040", " ") == str(target) and FSTYPE in line:
            with contextlib.suppress(OSError):
                Path(f"/sys/class/bdi/{fields[2]}/read_ahead_kb").write_text(str(_MAX_READ >> 10))
            return


def _mountinfo() -> list[str]:
    try:
        return Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []


class PageFile:
    """``target`` (an existing file) reads as ``size`` bytes from ``source`` until :meth:`close`.
    ``threads`` > 1 serve requests side by side, so that a fault's read need not wait behind a 1 MiB
    background read; measured on 2 cores it only adds GIL contention (1 GB: every page in 1.5 s
    with one thread, 1.8-2.2 s with two or four), hence one."""

    def __init__(self, target: Path, size: int, source: ReadSource, on_failure: Callable[[BaseException], None],
                 *, threads: int = 1, fail_fast: bool = False) -> None:
        self.target, self.size, self.source, self.on_failure = target, size, source, on_failure
        # fail_fast: answer a failed read with EIO at once; only for a reader that runs nothing on
        # what it reads before it has read it all (criu restore in full), never for a lazy daemon
        self.fail_fast = fail_fast
        self._threads = [threading.Thread(target=self.run, name=f"cedana-page-file-{i}", daemon=True)
                         for i in range(threads)]
        self._count = threading.Lock()
        self.error: BaseException | None = None
        self.requests = 0
        self.served_bytes = 0
        self.busy_seconds = 0.0
        self.pushed_bytes = 0
        self.first_request_at: float | None = None  # time.monotonic() of the first READ
        self._release = threading.Event()
        self._fd_open = threading.Lock()  # a push never writes to an fd number close() gave back
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = f"fd={self.fd},rootmode=100000,user_id=0,group_id=0,max_read={_MAX_READ}".encode()
        if _libc().mount(b"cedana-pages", str(target).encode(), FSTYPE.encode(),
                         ctypes.c_ulong(_MS_RDONLY | _MS_NOSUID | _MS_NODEV), opts) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"mounting a page file over {target}: {os.strerror(err)}")
        self._mounted = True

    def start(self) -> None:
        for t in self._threads:
            t.start()
        _widen_readahead(self.target)

    def release(self) -> None:
        """Let failed reads be answered (with EIO): the process they were for is dead by now."""
        self._release.set()

    def push(self, offset: int, pieces: Sequence[bytes | memoryview]) -> bool:
        """Put these bytes into the file's page cache before anyone asks (FUSE_NOTIFY_STORE): a
        reader's ``pread`` of them is then served by the kernel, without a request to us. Only
        whole pages become readable this way (``offset`` page-aligned; a short tail only at the
        end of the file), so the caller pushes page-aligned spans. False when the kernel refused
        (unmounted, the inode gone, an old kernel): nothing is lost, reads still come to us."""
        n = sum(len(d) for d in pieces)
        if n == 0:
            return True
        head = _OUT.pack(_OUT.size + _STORE_OUT.size + n, _NOTIFY_STORE, 0) + _STORE_OUT.pack(_ROOT_ID, offset, n, 0)
        with self._fd_open:
            if not self._mounted:
                return False
            try:
                os.writev(self.fd, [head, *within_iov_max(pieces, reserved=1)])
            except OSError:
                return False
        with self._count:
            self.pushed_bytes += n
        return True

    def _reply(self, unique: int, err: int = 0, data: Sequence[bytes | memoryview] = ()) -> None:
        n = _OUT.size + sum(len(d) for d in data)
        try:  # a reply is one write, and one write takes at most IOV_MAX buffers
            os.writev(self.fd, [_OUT.pack(n, -err, unique), *within_iov_max(data, reserved=1)])
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):  # the request was interrupted, or unmounted
                raise

    def run(self) -> None:
        buf = bytearray(_MAX_READ + 65536)
        while True:
            try:
                n = os.readv(self.fd, [buf])
            except OSError as e:
                if e.errno == errno.ENODEV:  # unmounted
                    return
                if e.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                    continue
                raise
            if n < _IN.size:
                continue
            _, op, unique, *_ = _IN.unpack_from(buf)
            body = memoryview(buf)[_IN.size:n]
            if op == _READ:
                _, off, want, *_ = _READ_IN.unpack_from(body)
                self._read(unique, off, want)
            elif op == _INIT:
                _, minor, _, _ = _INIT_IN.unpack_from(body)
                self._reply(unique, 0, [_INIT_OUT.pack(7, min(minor, 31), _MAX_READ, _FUSE_ASYNC_READ | _FUSE_MAX_PAGES,
                                                       16, 12, _MAX_READ, 1, _MAX_READ // 4096, 0, 0, *[0] * 7)])
            elif op == _GETATTR:
                now = int(time.time())
                self._reply(unique, 0, [_ATTR_OUT.pack(
                    86400, 0, 0, 1, self.size, (self.size + 511) // 512, now, now, now, 0, 0, 0,
                    stat.S_IFREG | 0o400, 1, 0, 0, 0, 4096, 0)])
            elif op == _OPEN:
                self._reply(unique, 0, [_OPEN_OUT.pack(1, _FOPEN_KEEP_CACHE, 0)])
            elif op in (_RELEASE, _FLUSH, _DESTROY):
                self._reply(unique)
            elif op in (_FORGET, _BATCH_FORGET, _INTERRUPT):
                pass
            else:
                self._reply(unique, errno.ENOSYS)

    def _read(self, unique: int, off: int, want: int) -> None:
        if self.first_request_at is None:
            self.first_request_at = time.monotonic()
        t0 = time.perf_counter()
        size = max(0, min(want, self.size - off))
        if self.error is None:
            try:
                pieces = self.source(off, size) if size else []
            except Exception as e:
                with self._count:
                    first, self.error = self.error is None, self.error or e
                if first:
                    self.on_failure(e)
            else:
                self._reply(unique, 0, pieces)
                with self._count:
                    self.requests += 1
                    self.served_bytes += size
                    self.busy_seconds += time.perf_counter() - t0
                return
        if not self.fail_fast:
            self._release.wait()  # see the module docstring: never before the tree is dead
        self._reply(unique, errno.EIO)

    def close(self) -> None:
        """Unmount (pending and later reads fail) and let go of the device."""
        self._release.set()
        with self._fd_open:
            if not self._mounted:
                return
            _libc().umount2(str(self.target).encode(), _MNT_DETACH)
            self._mounted = False
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)  # the unmount ends their reads of the device
        with self._fd_open:
            os.close(self.fd)

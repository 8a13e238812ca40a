"""Capture the regular files a frozen process tree holds open for writing.

CRIU records the size of every open file and refuses a restore where it differs ("bad size"); a
workload that appends to a log or a results file would be unrestorable after its next write, and on
another node the file would not exist at all. So the files are copied at CRIU's ``post-dump``
action, while the tree is still frozen, and the restore writes them back before ``criu restore``.

The copy runs in the supervisor, which is warm and not frozen: CRIU's action script is a few lines
of shell that hand the request over a FIFO and wait for the answer, where starting a Python
interpreter would keep the workload frozen 20-130 ms longer. With bash it runs no other program (its
``read -t`` times out by itself: 2.5 ms added to a serving worker's freeze); with a plain ``sh``,
``timeout``, ``tee`` and ``head`` do (5.7 ms). :class:`CaptureOnFreeze` is the supervisor's side of
that handshake.
"""

from __future__ import annotations

import errno
import os
import select
import shlex
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from ..failpoints import failpoint
from .procfs import open_for_writing_at, tree_pids

__all__ = ["capture", "CaptureOnFreeze"]


def _copy(src: str, dst: str) -> None:
    """Copy in the kernel where it can (copy_file_range); across filesystems (outputs on a volume, the
    work dir on local disk or tmpfs: EXDEV) or where it is unsupported, read and write instead."""
    with open(src, "rb") as i, open(dst, "wb") as o:
        left = os.fstat(i.fileno()).st_size
        try:
            while left > 0:
                n = os.copy_file_range(i.fileno(), o.fileno(), left)
                if n == 0:
                    break
                left -= n
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            shutil.copyfileobj(i, o, 1 << 20)  # from where the kernel copy stopped: both offsets moved together


def capture(root_pid: int, dest: Path) -> list[tuple[str, Path, int]]:
    """Copy every open-for-writing file of the tree into ``dest``; return [(path, copy, mode)]. Each is
    read through the tree's own descriptor (``/proc/PID/fd/N``), never by its path: the path could name
    another file by now (a symlink swapped in by someone who may write its folder), and we read as root."""
    dest.mkdir(parents=True, exist_ok=True)
    out: list[tuple[str, Path, int]] = []
    for i, (path, (mode, held)) in enumerate(sorted(open_for_writing_at(tree_pids(root_pid)).items())):
        copy = dest / str(i)
        _copy(held, str(copy))
        out.append((path, copy, mode))
    return out


#: Seconds the action script waits to hand over its request: a live supervisor reads it at once.
_REQUEST_TIMEOUT = 10

#: The bash the action script runs with, where the node has one; else a plain sh and three programs.
BASH = shutil.which("bash", path="/bin:/usr/bin")


class CaptureOnFreeze:
    """Answers CRIU's post-dump action script: captures the frozen tree's files, then lets it go.

    Use as a context manager around ``criu dump --action-script <script>``; afterwards
    ``captured`` holds what was copied. Any failure answers "fail", so the script exits non-zero and
    CRIU fails the dump rather than saving a checkpoint that could not be restored. The script gives
    up after ``timeout`` seconds, so a lost answer can never keep the workload frozen for good.
    """

    def __init__(self, folder: Path, timeout: int = 120, hold: Callable[[], str | None] | None = None) -> None:
        self.dest = folder / "captured"
        self.script = folder / "capture.sh"
        self._req, self._ack = folder / "capture.req", folder / "capture.ack"
        self._timeout = timeout
        self._done = threading.Event()
        self.captured: list[tuple[str, Path, int]] = []
        self.error: str | None = None
        # Called after the capture, the tree still frozen (a job's parts wait there for each other: run/job.py);
        # a line back fails the dump, and CRIU lets the tree run on without a checkpoint.
        self._hold = hold
        self.held_back: str | None = None  # what ``hold`` said

    def __enter__(self) -> CaptureOnFreeze:
        os.mkfifo(self._req, 0o600)
        os.mkfifo(self._ack, 0o600)
        # O_RDWR never blocks on a FIFO and keeps a writer open, so neither end sees a spurious EOF.
        self._req_fd = os.open(self._req, os.O_RDWR | os.O_CLOEXEC)
        self._ack_fd = os.open(self._ack, os.O_RDWR | os.O_CLOEXEC)
        self.script.write_text(self._script_text(BASH))
        self.script.chmod(0o700)
        self._thread = threading.Thread(target=self._serve, name="cedana-capture", daemon=True)
        self._thread.start()
        return self

    def _script_text(self, bash: str | None) -> str:
        req, ack = shlex.quote(str(self._req)), shlex.quote(str(self._ack))
        if bash:
            # Opened read-write, a FIFO never blocks (the script holds both ends): with the supervisor gone the
            # request lands in the pipe, the answer never comes, and read's own timeout ends the wait.
            return (f"#!{bash}\n"
                    '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
                    f"exec 3<>{req} 4<>{ack}\n"
                    'echo "$CRTOOLS_INIT_PID" >&3 || exit 1\n'
                    f'read -r -t {self._timeout} -u 4 answer && [ "$answer" = ok ]\n')
        return ("#!/bin/sh\n"
                '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
                # Both ends time out: with the supervisor gone nobody holds the FIFOs, an open would block
                # for good, and CRIU would keep the workload frozen.
                f'echo "$CRTOOLS_INIT_PID" | timeout {_REQUEST_TIMEOUT} tee {req} >/dev/null || exit 1\n'
                f'[ "$(timeout {self._timeout} head -n 1 {ack})" = ok ]\n')

    def _serve(self) -> None:
        while not self._done.is_set():
            ready, _, _ = select.select([self._req_fd], [], [], 0.05)
            if not ready:
                continue
            answer = b"fail\n"
            try:
                pid = int(os.read(self._req_fd, 64).split()[0])
                failpoint("heartbeat.frozen", workload=pid)  # CRIU is mid-dump, the tree frozen, waiting on us
                self.captured = capture(pid, self.dest)
                if self._hold is not None and (why := self._hold()) is not None:
                    self.held_back = why
                else:
                    answer = b"ok\n"
            except Exception as e:  # reported by the dump that waits on us
                self.error = f"{type(e).__name__}: {e}"
            finally:
                os.write(self._ack_fd, answer)
            return

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        os.close(self._req_fd)
        os.close(self._ack_fd)

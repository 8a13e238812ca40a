"""Facts about a live process tree, read from /proc: its PIDs and the files it holds open.

The engine reads them around a dump (which files to capture), the supervisor and the size estimate
read the tree's PIDs. Read-only, no signals sent: looking never disturbs the workload.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

__all__ = ["open_fds", "open_for_writing", "open_for_writing_at", "process_start", "tree_ended", "tree_pids"]


#: CAP_SYS_ADMIN's bit in /proc/PID/status Cap* masks (linux/capability.h).
CAP_SYS_ADMIN = 21


def has_cap_sys_admin() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (effective): what CRIU and a new PID namespace need. Root
    in a hardened container, or one whose capabilities were dropped, does not."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def tree_pids(root: int) -> list[int]:
    """The root and all its descendants (every thread's children), in discovery order."""
    out: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except FileNotFoundError:
                pass
    return out


def process_start(pid: int) -> int | None:
    """When a live process started (clock ticks since boot), or None when there is none or it is a
    zombie: with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime 22
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def tree_ended(init: int) -> bool:
    """Whether a killed PID namespace's ``init`` has taken everyone in it along: gone, or a zombie with
    one thread left (the kernel ends the namespace when the init's last thread exits; a leader that
    exited first is a zombie while its other threads still run)."""
    if process_start(init) is not None:
        return False
    try:
        return len(os.listdir(f"/proc/{init}/task")) <= 1
    except OSError:
        return True


def _flags(fdinfo: str) -> int:
    for line in fdinfo.splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0


def open_fds(pids: list[int]) -> Iterator[tuple[int, str, str]]:
    """(pid, fd, what it points at) for every descriptor the processes ``pids`` hold open; a process
    or a descriptor gone while looking is skipped."""
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, PermissionError):
            continue
        for fd in fds:
            try:
                yield pid, fd, os.readlink(f"/proc/{pid}/fd/{fd}")
            except (FileNotFoundError, PermissionError):
                continue


def open_for_writing(pids: list[int]) -> dict[str, int]:
    """{path: mode bits} of regular files some process in ``pids`` has open with O_WRONLY or O_RDWR."""
    return {path: mode for path, (mode, _) in open_for_writing_at(pids).items()}


def open_for_writing_at(pids: list[int]) -> dict[str, tuple[int, str]]:
    """:func:`open_for_writing`, each with where to read the very file the process holds
    (``/proc/PID/fd/N``): its path names what it was opened as, and may name another file by the time
    it is read (a rename, a symlink put in its place)."""
    found: dict[str, tuple[int, str]] = {}
    for pid, fd, target in open_fds(pids):
        if not target.startswith("/") or target.endswith(" (deleted)"):
            continue  # pipes, sockets, anon inodes; deleted files travel inside the CRIU image
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                if _flags(f.read()) & (os.O_WRONLY | os.O_RDWR) == 0:
                    continue
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            if stat.S_ISREG(st.st_mode):
                found[target] = (stat.S_IMODE(st.st_mode), f"/proc/{pid}/fd/{fd}")
        except (FileNotFoundError, PermissionError, ValueError):
            continue
    return found

"""Capture the regular files a frozen process tree holds open for writing.

CRIU records the size of every open file and refuses a restore where it differs ("bad size"); a
workload that appends to a log or a results file would be unrestorable after its next write, and on
another node the file would not exist at all. So at ``post-dump`` (the tree is still frozen) CRIU
runs this file as its action script; it copies each such file into the capture directory as
``0``, ``1``, ... and lists them in ``captured.idx``. The restore writes them back before
``criu restore``.

It runs while the workload is frozen, so it is run by path (``python -S -I capture.py``) and imports
nothing but ``os``, ``stat`` and ``sys``: about 20 ms of interpreter start instead of 130 ms.
Environment: CRIU's ``CRTOOLS_SCRIPT_ACTION`` and ``CRTOOLS_INIT_PID``, and ``CEDANA_CAPTURE_DIR``.
"""

from __future__ import annotations

import os
import stat
import sys

__all__ = ["tree_pids", "open_for_writing", "capture", "read_index", "CAPTURE_INDEX"]

#: The index: for each captured file, ``<mode>\0<path>\0``, in the order of the copies' names.
CAPTURE_INDEX = "captured.idx"


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


def _flags(fdinfo: str) -> int:
    for line in fdinfo.splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0


def open_for_writing(pids: list[int]) -> dict[str, int]:
    """{path: mode bits} of regular files some process in ``pids`` has open with O_WRONLY or O_RDWR."""
    found: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, PermissionError):
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if not target.startswith("/") or target.endswith(" (deleted)"):
                    continue  # pipes, sockets, anon inodes; deleted files travel inside the CRIU image
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    if _flags(f.read()) & (os.O_WRONLY | os.O_RDWR) == 0:
                        continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if stat.S_ISREG(st.st_mode):
                    found[target] = stat.S_IMODE(st.st_mode)
            except (FileNotFoundError, PermissionError, ValueError):
                continue
    return found


def _copy(src: str, dst: str) -> None:
    with open(src, "rb") as i, open(dst, "wb") as o:
        left = os.fstat(i.fileno()).st_size
        while left > 0:
            n = os.copy_file_range(i.fileno(), o.fileno(), left)
            if n == 0:
                break
            left -= n


def capture(root_pid: int, dest: str) -> list[tuple[str, str, int]]:
    """Copy every open-for-writing file of the tree into ``dest``; return [(path, copy, mode)]."""
    os.makedirs(dest, exist_ok=True)
    out: list[tuple[str, str, int]] = []
    with open(os.path.join(dest, CAPTURE_INDEX), "w", encoding="utf-8", errors="surrogateescape") as idx:
        for i, (path, mode) in enumerate(sorted(open_for_writing(tree_pids(root_pid)).items())):
            copy = os.path.join(dest, str(i))
            _copy(path, copy)
            idx.write(f"{mode}\0{path}\0")
            out.append((path, copy, mode))
    return out


def read_index(dest: str | os.PathLike[str]) -> list[tuple[str, str, int]]:
    """[(path, copy, mode)] as written by :func:`capture`; [] when nothing was captured."""
    try:
        with open(os.path.join(dest, CAPTURE_INDEX), encoding="utf-8", errors="surrogateescape") as f:
            fields = f.read().split("\0")[:-1]
    except FileNotFoundError:
        return []
    pairs = zip(fields[0::2], fields[1::2])
    return [(path, os.path.join(dest, str(i)), int(mode)) for i, (mode, path) in enumerate(pairs)]


def main() -> int:
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "post-dump":
        return 0
    capture(int(os.environ["CRTOOLS_INIT_PID"]), os.environ["CEDANA_CAPTURE_DIR"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Capture the regular files a frozen process tree holds open for writing.

CRIU records the size of every open file and refuses a restore where it differs ("bad size"); a
workload that appends to a log or a results file would be unrestorable after its next write, and on
another node the file would not exist at all. So at ``post-dump`` (the tree is still frozen) CRIU
runs this module as its action script; it copies each such file into ``<images>/captured/`` and
lists them in ``captured.json``. The restore writes them back before ``criu restore``.

Run as: ``python -m cedana_airflow.engine.capture`` with CRIU's environment
(``CRTOOLS_SCRIPT_ACTION``, ``CRTOOLS_INIT_PID``) and ``CEDANA_CAPTURE_DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

__all__ = ["tree_pids", "open_for_writing", "capture", "CAPTURE_INDEX"]

CAPTURE_INDEX = "captured.json"


def tree_pids(root: int) -> list[int]:
    """The root and all its descendants (every thread's children), in discovery order."""
    out, todo = [], [root]
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


def open_for_writing(pids: list[int]) -> dict[str, int]:
    """Paths of regular files some process in ``pids`` has open with O_WRONLY or O_RDWR -> mode bits."""
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
                    flags = _flags(f.read())
                if flags & (os.O_WRONLY | os.O_RDWR) == 0:
                    continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if stat.S_ISREG(st.st_mode):
                    found[target] = stat.S_IMODE(st.st_mode)
            except (FileNotFoundError, PermissionError, ValueError):
                continue
    return found


def _flags(fdinfo: str) -> int:
    for line in fdinfo.splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0


def capture(root_pid: int, dest: Path) -> list[dict[str, object]]:
    dest.mkdir(parents=True, exist_ok=True)
    index = []
    for i, (path, mode) in enumerate(sorted(open_for_writing(tree_pids(root_pid)).items())):
        copy = dest / str(i)
        shutil.copyfile(path, copy)
        index.append({"path": path, "copy": str(copy), "mode": mode})
    (dest / CAPTURE_INDEX).write_text(json.dumps(index))
    return index


def main() -> int:
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "post-dump":
        return 0
    capture(int(os.environ["CRTOOLS_INIT_PID"]), Path(os.environ["CEDANA_CAPTURE_DIR"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CRIU's ``proc.crtools``: the one thing a dump writes into the workload's working directory.

A workload runs in its own PID namespace but sees the host's /proc. CRIU's parasite (running inside
each dumped process) then cannot use /proc, so it makes a directory ``proc.crtools`` in the process's
working directory, mounts a proc there, opens it, unmounts and removes it: for a moment, on every dump
(CRIU 4.1, criu/pie/parasite.c). Measured here (8 workloads in one directory, dumped at once, 5 rounds):
5 of 40 dumps failed with ``Can't create a directory (-17)``, none when each had its own directory; a
``proc.crtools`` left behind by a dump killed in that moment fails every later dump of that directory.

So: a collision is retried (it is over in milliseconds); a leftover that is plainly stale (empty, not a
mount, untouched for a while) is removed before a dump; and the line for what remains names the cause.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
from collections.abc import Iterable

__all__ = ["NAME", "clear_stale", "collided", "hint", "working_dirs"]

log = logging.getLogger(__name__)

NAME = "proc.crtools"
#: A parasite holds its directory for milliseconds; one this old was left by a dump that died.
STALE_SECONDS = 30.0

_FAILED = re.compile(r"Can't create a directory \((-\d+)\)")


def working_dirs(pids: Iterable[int]) -> set[str]:
    """The working directories of the processes about to be dumped (where their parasites mkdir)."""
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/{pid}/cwd"))
    return out


def clear_stale(dirs: Iterable[str], now: float | None = None) -> list[str]:
    """Remove each ``<dir>/proc.crtools`` that is a plain empty directory, not a mount point, older than
    STALE_SECONDS; return what was removed. Anything else is left as it is (rmdir never removes content)."""
    now = time.time() if now is None else now
    removed = []
    for d in dirs:
        path = os.path.join(d, NAME)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or os.path.ismount(path) or now - st.st_mtime < STALE_SECONDS:
                continue
            os.rmdir(path)
        except OSError:
            continue
        log.warning("removed %s: left by a CRIU dump that was killed while it held it (every later dump of a "
                    "workload in %s would fail until then)", path, d)
        removed.append(path)
    return removed


def collided(tail: str) -> bool:
    """CRIU's line says another parasite held ``proc.crtools`` in the same directory (EEXIST)."""
    m = _FAILED.search(tail)
    return m is not None and m.group(1) == "-17"


def hint(tail: str, dirs: Iterable[str]) -> str:
    """The cause and fix for a dump that failed making ``proc.crtools``; '' for any other failure."""
    m = _FAILED.search(tail)
    if not m:
        return ""
    where = ", ".join(sorted(dirs)) or "the workload's working directory"
    what = (f"CRIU makes {NAME} for a moment in the working directory of each process it dumps ({where}), to "
            "mount /proc for the workload's PID namespace")
    if m.group(1) == "-17":
        return (f"{what}, and another dump held one there each time it tried (workloads sharing a working "
                f"directory, dumped at once), or one is left there: give each workload its own working "
                f"directory, or remove a leftover {NAME} that is empty")
    return f"{what}, and it could not ({os.strerror(-int(m.group(1)))}): start the workload from a writable directory"

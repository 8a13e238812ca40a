"""Writes of many buffers at once, within the kernel's limit on buffers per call.

Linux refuses a ``writev``/``pwritev``/``sendmsg`` of more than IOV_MAX (1024) buffers with EINVAL
(EMSGSIZE for sendmsg). Reads from a chunk view come back as one buffer per chunk, so a range of a
pages image over about 256 MiB (1024 chunks of at least a quarter of the 1 MiB average) is more
than one call may take: these helpers split it (the page server sends the same way).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["IOV_MAX", "advance", "pwritev_all", "within_iov_max"]

IOV_MAX: int = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

Buffer = bytes | bytearray | memoryview


def advance(left: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``left`` (buffers in order), after a write that took that many."""
    while left and n >= len(left[0]):
        n -= len(left[0])
        left.pop(0)
    if left and n:
        left[0] = left[0][n:]


def pwritev_all(fd: int, pieces: Sequence[Buffer], offset: int) -> int:
    """Write every piece at ``offset`` onward, however many there are, short writes resumed; the bytes written."""
    left = [memoryview(p).cast("B") for p in pieces if len(p)]
    done = 0
    while left:
        n = os.pwritev(fd, left[:IOV_MAX], offset + done)
        if n <= 0:
            raise OSError(f"pwritev wrote {n} bytes at {offset + done}")
        done += n
        advance(left, n)
    return done


def within_iov_max(pieces: Sequence[Buffer], reserved: int = 0) -> Sequence[Buffer]:
    """``pieces`` as they are when one call can take them with ``reserved`` other buffers, else joined
    into one: for a message that must go in one write (a FUSE reply)."""
    return pieces if len(pieces) + reserved <= IOV_MAX else [b"".join(pieces)]

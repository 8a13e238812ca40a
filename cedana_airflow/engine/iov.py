"""Writes of many buffers at once, within the kernel's limit on buffers per call.

Linux refuses a ``writev``/``pwritev``/``sendmsg`` of more than IOV_MAX (1024) buffers with EINVAL
(EMSGSIZE for sendmsg). Reads from a chunk view come back as one buffer per chunk, so a range of a
pages image over about 256 MiB (1024 chunks of at least a quarter of the 1 MiB average) is more
than one call may take: those helpers split it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

__all__ = ["IOV_MAX", "batches", "pwritev_all", "within_iov_max"]

IOV_MAX: int = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

Buffer = bytes | bytearray | memoryview


def batches(pieces: Sequence[Buffer], most: int = IOV_MAX) -> Iterator[Sequence[Buffer]]:
    """``pieces`` in runs of at most ``most``."""
    for i in range(0, len(pieces), most):
        yield pieces[i : i + most]


def pwritev_all(fd: int, pieces: Sequence[Buffer], offset: int) -> int:
    """Write every piece at ``offset`` onward, however many there are, short writes resumed; the bytes written."""
    done = 0
    for batch in batches(pieces):
        left = [memoryview(p).cast("B") for p in batch if len(p)]
        while left:
            n = os.pwritev(fd, left, offset + done)
            if n <= 0:
                raise OSError(f"pwritev wrote {n} bytes at {offset + done}")
            done += n
            while left and n >= len(left[0]):
                n -= len(left[0])
                left.pop(0)
            if left and n:
                left[0] = left[0][n:]
    return done


def within_iov_max(pieces: Sequence[Buffer], reserved: int = 0) -> Sequence[Buffer]:
    """``pieces`` as they are when one call can take them with ``reserved`` other buffers, else joined
    into one: for a message that must go in one write (a FUSE reply)."""
    return pieces if len(pieces) + reserved <= IOV_MAX else [b"".join(pieces)]

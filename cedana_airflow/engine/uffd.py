"""Whether this kernel can fill a restored tree's memory on demand, asked directly (no subprocess).

``criu check --feature uffd`` and ``--feature uffd-noncoop`` answer the same question, but each is
a CRIU process: about 40 ms of a restore that takes 150 ms before the workload runs (measured with
``restore --timings``, bench/README.md). The kernel answers in microseconds: open a userfaultfd
and read the features UFFDIO_API offers. ``doctor`` still asks CRIU (it also proves CRIU's side).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import struct

__all__ = ["NEEDED", "kernel_lazy_pages"]

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282, "ppc64le": 364, "s390x": 355}
_UFFD_API = 0xAA
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api { u64 api, features, ioctls })
_API = struct.Struct("=QQQ")
# what CRIU's uffd-noncoop needs: a tree's forks, mremaps, munmaps and madvise(DONTNEED)s reported
_EVENT_FORK, _EVENT_REMAP, _EVENT_REMOVE, _EVENT_UNMAP = 1 << 1, 1 << 2, 1 << 3, 1 << 6
NEEDED = _EVENT_FORK | _EVENT_REMAP | _EVENT_REMOVE | _EVENT_UNMAP


def kernel_lazy_pages() -> tuple[bool, str] | None:
    """(True, why) or (False, why) from the kernel itself; None when this machine cannot be asked
    this way (an architecture without a known syscall number), and CRIU must be asked instead."""
    nr = _SYS_USERFAULTFD.get(platform.machine())
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            return False, "the kernel has no userfaultfd (CONFIG_USERFAULTFD)"
        return False, f"userfaultfd: {os.strerror(err)}"
    try:
        buf = bytearray(_API.pack(_UFFD_API, 0, 0))
        fcntl.ioctl(fd, _UFFDIO_API, buf)
        features = _API.unpack(buf)[1]
    except OSError as e:
        return False, f"UFFDIO_API: {e.strerror}"
    finally:
        os.close(fd)
    missing = NEEDED & ~features
    if missing:
        return False, f"userfaultfd lacks the events a tree needs (features {features:#x}, missing {missing:#x})"
    return True, f"userfaultfd with fork, remap, remove and unmap events (features {features:#x})"

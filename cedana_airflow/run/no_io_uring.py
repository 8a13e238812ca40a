"""A workload tree without io_uring: ``io_uring_setup`` answers ENOSYS, as on a kernel built without it.

CRIU cannot checkpoint an io_uring, and since libuv 1.50 every libuv event loop takes one to batch its
epoll calls, whatever ``UV_USE_IO_URING`` says (libuv's src/unix/linux.c, commit 69bad8201). PyTorch
links libuv into libtorch_cpu.so for its TCPStore server, so every ``torchrun`` job's launcher (the
elastic agent, which hosts the rendezvous stores) holds two, and no PyTorch setting reaches them;
Node.js does the same. With the setup call refused, libuv (and liburing-based code that checks)
falls back to plain epoll, and the job runs as before, checkpointable.

A seccomp filter does it, installed by a small exec wrapper that becomes the workload's command
(Python in isolated mode, before anything of the workload runs) and inherited by everything the
tree starts. CRIU restores seccomp filters, so a restored tree keeps it. Root (CAP_SYS_ADMIN, which
a checkpointing node has anyway) installs it without ``no_new_privs``, so setuid programs in the
workload keep working; where the kernel refuses the filter the workload runs without it, and a tree
that then takes an io_uring is named at its first heartbeat (engine/fds.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["EXEC_WITHOUT_IO_URING", "without_io_uring"]

#: The wrapper: ``python -I -S -c EXEC_WITHOUT_IO_URING cmd args...`` installs the filter and execs cmd.
#: Self-contained (it runs with no site-packages). The filter, in classic BPF over ``seccomp_data``:
#: an architecture it does not know is let through; io_uring_setup (425 on every architecture, and
#: x32's 0x40000000 | 425) gets ENOSYS; everything else is allowed.
EXEC_WITHOUT_IO_URING = r"""
import ctypes, os, struct, sys
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(os.uname().machine)
if AUDIT_ARCH is not None:
    LD, JEQ, RET = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    ALLOW, ENOSYS = 0x7FFF0000, 0x00050000 | 38  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | ENOSYS
    prog = [(LD, 0, 0, 4), (JEQ, 0, 4, AUDIT_ARCH), (LD, 0, 0, 0), (JEQ, 1, 0, 425),
            (JEQ, 0, 1, 0x40000000 | 425), (RET, 0, 0, ENOSYS), (RET, 0, 0, ALLOW)]
    raw = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Prog(len(prog), ctypes.addressof(raw))
    ctypes.CDLL(None, use_errno=True).prctl(22, 2, ctypes.byref(fprog), 0, 0)  # PR_SET_SECCOMP, MODE_FILTER
try:
    os.execvp(sys.argv[1], sys.argv[1:])
except OSError as e:
    sys.stderr.write(f"{sys.argv[1]}: {e.strerror}\n")
    sys.exit(127)
"""


def without_io_uring(command: Sequence[str]) -> list[str]:
    """``command`` run under the filter (its pid, environment and arguments unchanged)."""
    return [sys.executable, "-I", "-S", "-c", EXEC_WITHOUT_IO_URING, *command]

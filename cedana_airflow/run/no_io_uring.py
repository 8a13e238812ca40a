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

import os
import struct
import sys
from collections.abc import Mapping, Sequence

__all__ = ["EXEC_WITHOUT_IO_URING", "KNOWN_MACHINES", "filter_program", "without_io_uring"]

# Every audit arch whose io_uring_setup is 425 (audit.h): x86_64, i386, aarch64, arm, ppc64le, ppc64,
# s390x, s390, riscv64, loongarch64. The filter checks the arch of each call, not uname's, so a 32-bit
# program (int 0x80, setarch i686) meets it too. x32 calls are x86_64's with bit 30 set; no other arch
# has a call numbered that high.
_ARCHES = (0xC000003E, 0x40000003, 0xC00000B7, 0x40000028, 0xC0000015, 0x80000015, 0x80000016, 0x00000016,
           0xC00000F3, 0xC0000102)
#: The machines (uname) the filter knows: elsewhere (MIPS and Alpha number the call otherwise) none is installed.
KNOWN_MACHINES = ("x86_64", "i386", "i686", "aarch64", "armv7l", "armv8l", "ppc64le", "ppc64", "s390x", "riscv64",
                  "loongarch64")


def _program() -> list[tuple[int, int, int, int]]:
    """The filter, in classic BPF over ``seccomp_data``: io_uring_setup (425 on every architecture it
    knows, 64-bit or 32-bit, or x32's 0x40000000 | 425) gets ENOSYS; every other call, and every call
    of an architecture it does not know, is allowed."""
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, enosys = 0x7FFF0000, 0x00050000 | 38  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | ENOSYS
    n = len(_ARCHES)
    prog = [(ld, 0, 0, 4)]  # seccomp_data.arch
    prog += [(jeq, n - i, 0, a) for i, a in enumerate(_ARCHES)]  # a known arch: on to the number
    prog += [(ret, 0, 0, allow), (ld, 0, 0, 0),  # seccomp_data.nr
             (jeq, 2, 0, 425), (jeq, 1, 0, 0x40000000 | 425), (ret, 0, 0, allow), (ret, 0, 0, enosys)]
    return prog


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter as ``struct sock_filter`` bytes, for a process that installs it itself before it execs
    the workload (the agent's shim); None on a machine it does not know."""
    if (machine or os.uname().machine) not in KNOWN_MACHINES:
        return None
    return b"".join(struct.pack("HBBI", *i) for i in _program())


#: The wrapper: ``python -I -S -c EXEC_WITHOUT_IO_URING =LC_CTYPE|'' cmd args...`` installs the filter and
#: execs cmd. Self-contained (it runs with no site-packages): the program and the machines are literals.
EXEC_WITHOUT_IO_URING = r"""
import ctypes, os, signal, struct, sys
lc_ctype, argv = sys.argv[1], sys.argv[2:]  # "=VALUE" as the workload was given it, or "" for none
KNOWN = """ + repr(KNOWN_MACHINES) + r"""
if os.uname().machine not in KNOWN:
    sys.stderr.write(f"cedana: io_uring is not refused to this workload (no filter for {os.uname().machine}); one "
                     "it takes cannot be checkpointed\n")
else:
    prog = """ + repr(_program()) + r"""
    raw = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Prog(len(prog), ctypes.addressof(raw))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        sys.stderr.write(f"cedana: io_uring is not refused to this workload ({os.strerror(ctypes.get_errno())}); "
                         "one it takes cannot be checkpointed\n")
# what CPython's start-up changed, put back: the exec'd program gets the dispositions and environment
# the workload was started with (SIGPIPE and SIGXFSZ ignored, LC_CTYPE coerced: PEP 538)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
if lc_ctype:
    os.environ["LC_CTYPE"] = lc_ctype[1:]
else:
    os.environ.pop("LC_CTYPE", None)
try:
    os.execvp(argv[0], argv)
except OSError as e:
    sys.stderr.write(f"{argv[0]}: {e.strerror}\n")
    sys.exit(127)
"""


def without_io_uring(command: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """``command`` run under the filter, with its pid, arguments, environment (``env``, else ours) and
    signal dispositions unchanged."""
    lc_ctype = (env if env is not None else os.environ).get("LC_CTYPE")
    return [sys.executable, "-I", "-S", "-c", EXEC_WITHOUT_IO_URING, "" if lc_ctype is None else f"={lc_ctype}", *command]

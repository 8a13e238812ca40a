"""A transparent workload's tree gets no io_uring (issue 47): torchrun's launcher took two through libuv
1.50's TCPStore server and failed every heartbeat. The filter answers io_uring_setup with ENOSYS, in
the workload and in what it starts, and leaves every other call alone."""

from __future__ import annotations

import sys
import time

from cedana_airflow.run.workload import Workload
from test_workload import _Collect

#: Tries io_uring_setup in the process and in a child it forks, says what each got, and reads a file
#: (any other syscall works as before).
_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def ring():
    r = libc.syscall(425, 4, ctypes.create_string_buffer(120))
    return "ring" if r >= 0 else os.strerror(ctypes.get_errno())
pid = os.fork()
if pid == 0:
    print("child:", ring(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("parent:", ring(), "seccomp", open("/proc/self/status").read().split("Seccomp:")[1].split()[0], flush=True)
"""


def _run(deny: bool) -> str:
    out, err = _Collect(), _Collect()
    w = Workload.start([sys.executable, "-c", _PROBE], stdout=out, stderr=err, deny_io_uring=deny)
    deadline = time.monotonic() + 30
    while w.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.wait(5) == 0, err.getvalue()
    return out.getvalue().decode()


def test_the_tree_and_its_children_get_enosys_from_io_uring_setup():
    assert _run(deny=True) == "child: Function not implemented\nparent: Function not implemented seccomp 2\n"


def test_without_the_filter_the_workload_gets_its_ring():
    assert _run(deny=False) == "child: ring\nparent: ring seccomp 0\n"


def test_what_the_workload_is_started_with_is_what_it_gets():
    """The wrapper is Python: its start-up ignores SIGPIPE and SIGXFSZ and coerces LC_CTYPE (PEP 538); the
    workload must see neither (a pipeline's `yes | head` would print 'Broken pipe')."""
    import os
    import subprocess

    from cedana_airflow.run.no_io_uring import without_io_uring

    cmd = ["sh", "-c", "grep SigIgn /proc/self/status; echo LC_CTYPE=${LC_CTYPE-unset}; yes | head -1"]
    for env in ({k: v for k, v in os.environ.items() if not k.startswith("LC_") and k != "LANG"},
                {**os.environ, "LC_CTYPE": "de_DE.UTF-8"}):
        plain = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wrapped = subprocess.run(without_io_uring(cmd, env), env=env, capture_output=True, text=True)
        assert (wrapped.stdout, wrapped.stderr) == (plain.stdout, plain.stderr), (wrapped, plain)


def test_a_32_bit_call_gets_no_ring_either(tmp_path):
    """On x86-64, io_uring_setup through the i386 ABI (int 0x80, or a 32-bit program) is refused too."""
    import platform
    import shutil
    import subprocess

    import pytest

    from cedana_airflow.run.no_io_uring import without_io_uring

    if platform.machine() != "x86_64" or shutil.which("gcc") is None:
        pytest.skip("needs x86-64 and gcc")
    src = tmp_path / "uring32.c"
    src.write_text(r"""
#include <stdio.h>
#include <string.h>
int main(void) {
    static unsigned char params[120];
    long r;
    memset(params, 0, sizeof params);
    __asm__ volatile ("int $0x80" : "=a"(r) : "a"(425), "b"(4), "c"((long)(unsigned long)params) : "memory");
    printf("%ld\n", r);
    return 0;
}
""")
    exe = tmp_path / "uring32"
    # the buffer must be addressable with 32 bits: a non-PIE binary keeps its .bss low
    subprocess.run(["gcc", "-O0", "-no-pie", "-o", str(exe), str(src)], check=True)
    plain = subprocess.run([str(exe)], capture_output=True, text=True).stdout.strip()
    wrapped = subprocess.run(without_io_uring([str(exe)]), capture_output=True, text=True).stdout.strip()
    assert int(plain) >= 0, plain  # a ring, where nothing refuses it (the test can fail)
    assert wrapped == "-38", wrapped  # -ENOSYS


def test_under_setarch_i686_the_filter_is_there_too():
    """``setarch i686`` makes uname say i686: the filter is chosen by each call's arch, not by uname's, so
    the workload still gets no ring (review 3 saw none installed)."""
    import shutil
    import subprocess

    import pytest

    from cedana_airflow.run.no_io_uring import without_io_uring

    if shutil.which("setarch") is None or subprocess.run(["setarch", "i686", "true"]).returncode != 0:
        pytest.skip("setarch i686 is not available here")
    r = subprocess.run(["setarch", "i686", *without_io_uring([sys.executable, "-c", _PROBE])], capture_output=True,
                       text=True, timeout=60)
    assert r.stdout == "child: Function not implemented\nparent: Function not implemented seccomp 2\n", r

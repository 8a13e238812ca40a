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

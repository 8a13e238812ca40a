"""How a workload's end is reported: a real process under real ``unshare --pid --fork``, killed the way
a lost node or the OOM killer kills it. Debian 12's util-linux (2.38) answers a SIGKILLed child with
"unshare: sigprocmask unblock failed: Invalid argument" and exit 1; the user must see neither."""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time

from cedana_airflow.run.workload import Workload, _UnshareNoise

NOISE = b"unshare: sigprocmask unblock failed: Invalid argument\n"


class _Collect(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, data: bytes, /) -> int:  # type: ignore[override]
        with self.lock:
            return super().write(data)


def _start(source: str) -> tuple[Workload, _Collect, _Collect]:
    out, err = _Collect(), _Collect()
    w = Workload.start([sys.executable, "-c", source], stdout=out, stderr=err)
    return w, out, err


def test_a_workload_killed_by_sigkill_is_reported_as_killed_by_sigkill_without_unshares_line():
    w, out, err = _start("import sys, time\nprint('step 1', flush=True)\nprint('warming up', file=sys.stderr, "
                         "flush=True)\ntime.sleep(60)")
    deadline = time.monotonic() + 10
    # the whole line: print writes the text and its newline apart, and a kill between them is no bug of ours
    while b"warming up\n" not in err.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(w.pid, signal.SIGKILL)  # the namespace's init, from outside: what the demo's lost node does
    assert w.wait(timeout=30) == 128 + signal.SIGKILL
    assert w.signal == signal.SIGKILL
    assert err.getvalue() == b"warming up\n"  # its own stderr, and nothing of unshare's
    assert out.getvalue() == b"step 1\n"


def test_a_workload_that_exits_1_is_not_taken_for_a_kill():
    w, _, err = _start("import sys\nprint('bad input', file=sys.stderr)\nsys.exit(1)")
    assert w.wait(timeout=30) == 1 and w.signal is None
    assert err.getvalue() == b"bad input\n"


def test_unshares_line_is_dropped_even_in_pieces_and_a_look_alike_passes():
    got = io.BytesIO()
    f = _UnshareNoise(got)
    for piece in (b"loss 0.1\nunshare: ", b"sigprocmask unblock failed", b": Invalid argument", b"\n"):
        f.write(piece)
    f.finish()
    assert got.getvalue() == b"loss 0.1\n" and f.seen
    got = io.BytesIO()
    f = _UnshareNoise(got)
    f.write(b"unshare: sigprocmask unblock failed: Invalid argument, says my own script\nunsh")
    f.finish()  # EOF: the held "unsh" was the workload's own
    assert got.getvalue() == b"unshare: sigprocmask unblock failed: Invalid argument, says my own script\nunsh"
    assert not f.seen
    got = io.BytesIO()
    f = _UnshareNoise(got)
    f.write(NOISE[:10] + b"X\n")  # a prefix that turns out different is passed on whole
    assert got.getvalue() == NOISE[:10] + b"X\n"


def test_unshares_line_is_found_after_a_progress_bar_that_left_no_newline():
    got = io.BytesIO()
    f = _UnshareNoise(got)
    f.write(b"\rtrain |#####     | 5/10" + NOISE)  # one read: the bar's last state, then unshare's line
    f.finish()
    assert got.getvalue() == b"\rtrain |#####     | 5/10" and f.seen


def test_the_restored_trees_output_waits_for_the_announcement_and_keeps_its_order():
    from cedana_airflow.run.runner import _Held

    log: list[tuple[str, bytes]] = []

    class Sink:
        def __init__(self, name: str) -> None:
            self.name = name

        def write(self, data: bytes, /) -> int:
            if data == b"boom":
                raise OSError("the log is closed")
            log.append((self.name, data))
            return len(data)

        def flush(self) -> None:
            pass

    held = _Held()
    out, err = held.sink(Sink("out")), held.sink(Sink("err"))
    for sink, data in ((out, b"step 8"), (err, b"warn"), (out, b"boom"), (out, b"step 9")):
        sink.write(data)
    assert log == []  # nothing before the restore is announced
    log.append(("log", b"cedana: restored seq 7"))
    held.release()
    out.write(b"step 10")
    # the announcement first, then both streams in the order they were written; a failed write loses
    # only itself
    assert log == [("log", b"cedana: restored seq 7"), ("out", b"step 8"), ("err", b"warn"), ("out", b"step 9"),
                   ("out", b"step 10")]


#: A tree whose death takes a while (the kernel ends 100 processes of 8 MiB each), and its supervisor, which
#: starts its watchdog with the write end of a pipe as a lazy restore gives it the uffds, then waits to be
#: killed.
_BIG_TREE = ("import os, time\n"
             "for _ in range(100):\n"
             "    if os.fork() == 0:\n"
             "        b = bytearray(os.urandom(1) * (8 << 20)); time.sleep(600)\n"
             "b = bytearray(os.urandom(1) * (200 << 20)); time.sleep(600)\n")
_SUPERVISOR = r"""
import os, sys, time
from cedana_airflow.run.workload import Workload, _watchdog
w = Workload.start([sys.executable, "-c", sys.argv[2]])
held = int(sys.argv[1])
w._watchdog = _watchdog(w.pid, (held,))
os.close(held)
print(w.pid, flush=True)
time.sleep(600)
"""


def _tree(pid: int) -> list[int]:
    """The workload's processes: ``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{tid}/children").read().split()]
        except OSError:
            pass
    return out


def test_the_watchdog_holds_what_it_was_given_until_the_killed_tree_is_dead():
    """What a lazy restore gives the watchdog (the uffds) keeps the tree's faults blocked until the
    tree is dead. It ran `kill -KILL` and exited at once: until the kernel had ended the rest of the
    namespace, its faults resolved to zero pages."""
    import subprocess
    r, w = os.pipe()
    sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, str(w), _BIG_TREE], pass_fds=(w,), stdout=subprocess.PIPE,
                           text=True)
    os.close(w)
    try:
        assert sup.stdout is not None
        pid = int(sup.stdout.readline())
        deadline = time.monotonic() + 30
        while len(_tree(pid)) < 101:
            assert time.monotonic() < deadline, "the workload never started its processes"
            time.sleep(0.05)
        time.sleep(1)  # their memory filled
        sup.kill()  # the supervisor dies (OOM killer, a worker crash): the watchdog kills the tree
        sup.wait()
        assert os.read(r, 1) == b""  # the watchdog let go of what it held ...
        try:
            state = [ln.split()[1] for ln in open(f"/proc/{pid}/status") if ln.startswith("State:")][0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            state = "gone"
        assert state in ("Z", "gone"), f"the watchdog let go while the tree's init was still {state}"  # ... once it was dead
    finally:
        os.close(r)
        sup.kill()


#: An init whose main thread ends first (pthread_exit in main): its leader is a zombie while its other
#: thread, holding 2 GiB so that its exit takes a while, still runs, and the namespace's other process too.
_LEADER_FIRST = r"""
import ctypes, mmap, os, threading, time
if os.fork() == 0:
    while True:
        time.sleep(1)
def worker():
    m = mmap.mmap(-1, 2 << 30)
    for off in range(0, len(m), 4096):
        m[off] = 1
    print("ready", flush=True)
    while True:
        time.sleep(1)
threading.Thread(target=worker).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_the_watchdog_waits_for_the_init_s_last_thread_not_its_leader():
    """The kernel ends a namespace when its init's last thread exits (zap_pid_ns_processes); a leader
    that exited first shows State: Z at once. Taking that zombie for a dead tree let go of the uffds
    while the namespace's processes still ran (found by review, reproduced)."""
    import subprocess
    from cedana_airflow.run.workload import _WATCHDOG
    launcher = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", _LEADER_FIRST], stdout=subprocess.PIPE)
    supervisor = subprocess.Popen(["sleep", "1000"])
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == b"ready"
        [init] = [p for p in _tree(launcher.pid) if p != launcher.pid and _parent(p) == launcher.pid]
        [other] = [p for p in _tree(init) if p != init]
        watchdog = subprocess.Popen(["sh", "-c", _WATCHDOG, "cedana-watchdog", str(supervisor.pid), str(init)])
        supervisor.kill()
        supervisor.wait()
        watchdog.wait(60)
        assert _state(other) in ("Z", "gone"), f"the watchdog let go while {other} of the namespace was {_state(other)}"
    finally:
        supervisor.kill()
        launcher.kill()
        launcher.wait()


def _parent(pid: int) -> int:
    return int([ln.split()[1] for ln in open(f"/proc/{pid}/status") if ln.startswith("PPid:")][0])


def _state(pid: int) -> str:
    try:
        return [ln.split()[1] for ln in open(f"/proc/{pid}/status") if ln.startswith("State:")][0]
    except (OSError, IndexError):
        return "gone"

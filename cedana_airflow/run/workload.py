"""A workload: the process tree we supervise. Start it, stream its output, wait for it, stop it.

A workload runs as ``unshare --pid --fork setsid COMMAND``: COMMAND is the init of its own PID
namespace and leads its own session. That is what makes it restorable anywhere: CRIU restores a
PID namespace with the same PIDs inside it, so no PID on the target node can be "in use".
How the workload ended is reported as a shell would (the exit code, or 128 + the signal that killed
it), and :attr:`Workload.signal` names the signal.

stdout and stderr are pipes whose read ends the supervisor owns; it copies them to its own output.
After a restore, CRIU hands fresh pipes to the restored process (``--inherit-fd``), so the output
keeps flowing to whoever supervises now. The supervisor makes itself a child subreaper, so a
restored workload (detached by ``criu restore -d``) becomes its child and its exit code comes back.

A task outside the opt-in list runs unprotected (:func:`run_unprotected`): a plain subprocess, no
namespace and no CRIU, with the same output pump and the same way to stop it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from ..engine.procfs import tree_pids
from ..errors import CommandNotFound, EngineError, EngineUnavailable
from .no_io_uring import without_io_uring

__all__ = ["Sink", "Starter", "Workload", "become_subreaper", "exit_code_of", "pipe_name", "run_unprotected"]

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Adopt orphaned descendants (a restored workload, and orphans this machine's init won't reap)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


#: util-linux before 2.40 (Debian 12 has 2.38) cannot pass on a SIGKILL that ended the child of
#: ``unshare --fork``: it tries to reset SIGKILL's disposition before re-raising it, which fails, so it
#: prints this line and exits 1 instead (util-linux PR #2617, fixed in 2.40). That line on the launcher's
#: stderr with exit status 1 means the namespace's init was killed by SIGKILL; the user's log gets the
#: signal, not the line (the workload's own stderr is the same pipe, so it is held back there).
_UNSHARE_SIGKILL_LINE = b"unshare: sigprocmask unblock failed: Invalid argument"


def exit_code_of(status: int) -> int:
    """A wait status as a shell would report it: the exit code, or 128 + signal number."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Sink(Protocol):
    """Where a workload's output goes: a binary stream (sys.stdout.buffer, a file) or a task log's sink."""

    def write(self, data: bytes, /) -> int: ...
    def flush(self) -> None: ...


def pipe_name(fd: int) -> str:
    """How /proc names the pipe ``fd`` is an end of (what a manifest records, and CRIU's --inherit-fd matches)."""
    return f"pipe:[{os.fstat(fd).st_ino}]"


class _UnshareNoise:
    """The stderr sink of a fresh start, less util-linux's line about a SIGKILLed init (see
    _UNSHARE_SIGKILL_LINE). unshare writes it last, wherever the workload's own output left off (after a
    progress bar's ``\r`` with no newline, say), and it may arrive in pieces: so it is looked for
    anywhere, and only a tail that could still become it is held back until the next write or EOF."""

    _LINE = _UNSHARE_SIGKILL_LINE + b"\n"

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.seen = False
        self._held = b""

    def write(self, data: bytes, /) -> int:
        buf = self._held + data
        if self._LINE in buf:
            buf, self.seen = buf.replace(self._LINE, b"", 1), True
        keep = next((k for k in range(min(len(buf), len(self._LINE) - 1), 0, -1) if buf.endswith(self._LINE[:k])), 0)
        out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        if out:
            self.sink.write(out)
        return len(data)

    def flush(self) -> None:
        self.sink.flush()

    def finish(self) -> None:
        """At EOF: a held tail was the workload's own after all."""
        if self._held:
            self.sink.write(self._held)
            self._held = b""
            self.sink.flush()


class _Pump(threading.Thread):
    """Copies one pipe to one of our streams until EOF."""

    def __init__(self, read_fd: int, sink: Sink, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.read_fd, self.sink = read_fd, sink

    def run(self) -> None:
        try:
            while chunk := os.read(self.read_fd, 1 << 16):
                self.sink.write(chunk)
                self.sink.flush()
        except (OSError, ValueError):
            pass
        finally:
            os.close(self.read_fd)


class Workload:
    """One managed process tree, started fresh (:meth:`start`) or restored (:meth:`adopt`)."""

    def __init__(self, pid: int, command: Sequence[str], cwd: str, out_fd: int, err_fd: int,
                 launcher: subprocess.Popen[bytes] | None, stdout: Sink, stderr: Sink, *, ended: bool = False,
                 watchdog_holds: tuple[int, ...] = ()) -> None:
        self.pid = pid  # host PID of the namespace's init: what CRIU dumps
        self.command = tuple(command)
        self.cwd = cwd
        self.stdout_pipe = pipe_name(out_fd)
        self.stderr_pipe = pipe_name(err_fd)
        self._launcher = launcher
        self._noise = _UnshareNoise(stderr) if launcher is not None else None
        self._pumps = [_Pump(out_fd, stdout, "cedana-stdout"), _Pump(err_fd, self._noise or stderr, "cedana-stderr")]
        for p in self._pumps:
            p.start()
        self.returncode: int | None = None
        self.signal: int | None = None  # the signal that ended the workload, when one did
        self._reap_lock = threading.Lock()
        # A tree that ended before we saw it (a short command) needs no watchdog: nothing is left to kill.
        self._watchdog = None if ended else _watchdog(pid, watchdog_holds)

    @classmethod
    def start(cls, command: Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
              stdout: Sink | None = None, stderr: Sink | None = None, isolate: bool = True,
              deny_io_uring: bool = False) -> Workload:
        """Start ``command`` as the init of a new PID namespace (what CRIU dumps as one tree); with
        ``isolate=False`` (no root: a cooperative run) as the leader of a new session instead.
        ``deny_io_uring``: the tree gets no io_uring, which CRIU cannot dump (no_io_uring.py)."""
        cwd = cwd or os.getcwd()
        _check_command(command, cwd, env)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            inner = without_io_uring(command, env) if deny_io_uring and isolate else list(command)
            launcher = subprocess.Popen(
                ["unshare", "--pid", "--fork", "setsid", *inner] if isolate else list(command),
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, cwd=cwd, env=env,
                start_new_session=True,
            )
        except FileNotFoundError as e:
            os.close(out_r)
            os.close(err_r)
            what = "'unshare' (util-linux) is not installed" if e.filename == "unshare" else f"{e.filename}: no such file"
            raise EngineUnavailable(f"cannot start the workload: {what}. Install util-linux or check cwd {cwd}.") from None
        finally:
            os.close(out_w)
            os.close(err_w)
        if not isolate:  # the command is the launcher: the session leader, and what is signalled and waited for
            return cls(launcher.pid, command, cwd, out_r, err_r, launcher, stdout or sys.stdout.buffer,
                       stderr or sys.stderr.buffer)
        pid = _child_of(launcher)
        if pid is None:  # it ran and ended before we saw it: its exit code is the launcher's
            return cls(launcher.pid, command, cwd, out_r, err_r, launcher, stdout or sys.stdout.buffer,
                       stderr or sys.stderr.buffer, ended=True)
        return cls(pid, command, cwd, out_r, err_r, launcher, stdout or sys.stdout.buffer, stderr or sys.stderr.buffer)

    @classmethod
    def adopt(cls, pid: int, command: Sequence[str], cwd: str, out_r: int, err_r: int,
              stdout: Sink | None = None, stderr: Sink | None = None, *, watchdog_holds: tuple[int, ...] = ()) -> Workload:
        """Supervise a restored tree whose root ``pid`` is our child (we are its subreaper).
        ``watchdog_holds``: fds the watchdog keeps open until it has killed the tree (a lazy
        restore's page socket: see lazy_restore.py)."""
        return cls(pid, command, cwd, out_r, err_r, None, stdout or sys.stdout.buffer, stderr or sys.stderr.buffer,
                   watchdog_holds=watchdog_holds)

    def pids(self) -> list[int]:
        """The host PIDs of the whole tree, root first."""
        return tree_pids(self.pid)

    def criu_dump_options(self) -> tuple[str, ...]:
        """More of CRIU's options for dumping this tree (the node agent's trees in namespaces of their own
        name their mounts: agent/trees.py). None for a tree in the supervisor's namespaces."""
        return ()

    def poll(self) -> int | None:
        with self._reap_lock:  # the heartbeat thread polls too; only one may reap
            return self._poll()

    def _poll(self) -> int | None:
        if self.returncode is None:
            if self._launcher is not None:
                rc = self._launcher.poll()
                if rc is not None:  # unshare re-raises the signal that ended its child
                    self.returncode, self.signal = (128 - rc, -rc) if rc < 0 else (rc, None)
            else:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    log.warning("workload pid=%d is not our child any more; its exit code is lost (reported as 255)", self.pid)
                    self.returncode = 255
                else:
                    if pid:
                        self.returncode = exit_code_of(status)
                        self.signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        for p in self._pumps:
            p.join(timeout=5)  # a grandchild that keeps the pipe open must not hang us
        if self._noise is not None and not self._pumps[1].is_alive():
            self._noise.finish()
            if self._noise.seen and self.returncode == 1:  # util-linux < 2.40 and a SIGKILLed init
                self.returncode, self.signal = 128 + signal.SIGKILL, signal.SIGKILL
        if self._watchdog is not None and self._watchdog.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # its session: the shell and its `sleep`, not left behind
                os.killpg(self._watchdog.pid, signal.SIGKILL)
            self._watchdog.wait()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the workload's whole session (its init ignores what it has no handler for)."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the session and the namespace's init (the kernel then ends every process in it); not waited for."""
        self.send_signal(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def stop(self, grace: float, sig: int = signal.SIGTERM) -> int | None:
        """Send ``sig`` to the tree, wait ``grace`` seconds, then SIGKILL its init (ending the namespace)."""
        self.send_signal(sig)
        rc = self.wait(timeout=grace)
        if rc is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = self.wait(timeout=30)
        return rc


class Starter(Protocol):
    """What starts a fresh tree for a run: :meth:`Workload.start`, or the node agent's shim, which starts
    it as the agent's caller (agent/workloads.py)."""

    def __call__(self, command: Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
                 stdout: Sink | None = None, stderr: Sink | None = None, isolate: bool = True,
                 deny_io_uring: bool = False) -> Workload: ...


def run_unprotected(command: Sequence[str], *, cwd: str | None, env: dict[str, str] | None, sink: Sink,
                    stop: threading.Event, grace: float) -> int:
    """Run ``command`` as a plain subprocess, stdout and stderr together into ``sink``, and return its exit
    code (negative: the signal that ended it). Setting ``stop`` sends SIGTERM, and SIGKILL ``grace``
    seconds later."""
    _check_command(command, cwd or os.getcwd(), env)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    try:
        proc = subprocess.Popen(list(command), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out_w,
                                stderr=out_w, start_new_session=True)
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
    pump = _Pump(out_r, sink, "cedana-output")
    pump.start()
    while proc.poll() is None:
        # is_set() and a sleep, never stop.wait(): stop is set from inside a signal handler (Airflow's on_kill),
        # which runs in this thread and would wait for ever on the event's lock if this thread held it
        if stop.is_set():
            log.info("the task is being stopped; the workload tree ends")
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
        time.sleep(0.1)
    pump.join(5)  # a grandchild that keeps the pipe open must not hang us
    return proc.wait()


#: Shell that returns once the supervisor ($1) has died (gone or a zombie). Builtins only, one
#: `sleep` a second: what a helper that must outlive a killed supervisor runs first.
WAIT_FOR_SUPERVISOR = r"""
state_of() { state=; while read -r key value _; do [ "$key" = State: ] && state=$value && break; done < /proc/$1/status; }
while :; do
  state_of "$1"
  case "$state" in ""|Z) break ;; esac
  sleep 1
done 2>/dev/null
"""
# Then kills the workload's init ($2), which ends its whole PID namespace, and holds what it was given
# (a lazy restore's userfaultfds) until that is done: the kernel ends everyone else in the namespace
# when the init's last thread exits (kernel/exit.c, zap_pid_ns_processes), so the init is done once it
# is gone, or a zombie with one thread left (a leader that exited first is a zombie while its other
# threads live). Let go earlier, a process not yet killed would find its missing pages answered with zeros.
_WATCHDOG = WAIT_FOR_SUPERVISOR + r"""kill -KILL "$2" 2>/dev/null
one() { [ $# -le 1 ]; }
while :; do
  state_of "$2"
  case "$state" in "") break ;; Z) one /proc/$2/task/* && break ;; esac
  sleep 0.02
done 2>/dev/null
"""


def _watchdog(workload_pid: int, holds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """A workload must not outlive its supervisor: killed with SIGKILL (OOM killer, a worker crash),
    the supervisor can no longer checkpoint or stop it, and a retry would race a headless copy.
    The workload cannot carry a parent-death signal instead: CRIU would restore it, and it would
    fire when ``criu restore -d`` exits."""
    return subprocess.Popen(
        ["sh", "-c", _WATCHDOG, "cedana-watchdog", str(os.getpid()), str(workload_pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        pass_fds=holds,
    )


def _check_command(command: Sequence[str], cwd: str, env: dict[str, str] | None) -> None:
    """A command that cannot be executed is one line and exit code 127, not a launcher failure."""
    if not command:
        raise CommandNotFound("the workload's command is empty. Give the command after '--'.")
    name = command[0]
    if "/" in name:
        path = os.path.normpath(os.path.join(cwd, name))
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return
        where = f"at {path}"
    else:
        search = (env if env is not None else os.environ).get("PATH", os.defpath)
        if shutil.which(name, path=search) is not None:
            return
        where = "on PATH"
    raise CommandNotFound(f"command not found: {name!r} is not an executable file {where}. Check the command, "
                          "its path and PATH.")


def _child_of(launcher: subprocess.Popen[bytes], timeout: float = 10.0) -> int | None:
    """The host PID of the namespace init that ``unshare --fork`` started; None when it has already
    ended (a short command), whose exit code is then the launcher's."""
    deadline = time.monotonic() + timeout
    path = f"/proc/{launcher.pid}/task/{launcher.pid}/children"
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                kids = f.read().split()
            if kids:
                return int(kids[0])
        except FileNotFoundError:
            pass
        if launcher.poll() is not None:
            return None
        time.sleep(0.005)
    launcher.kill()
    raise EngineError(
        f"the workload did not start under 'unshare --pid --fork' (launcher exit {launcher.returncode}). "
        "Check that util-linux's unshare is installed and that this runs as root."
    )

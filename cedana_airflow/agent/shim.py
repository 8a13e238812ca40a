"""The shim: one small root process per workload, started by the node agent, that outlives it.

Its invariants (each has a test in tests/agent/test_shim.py or test_agent.py):

- **A tree never outlives its caller.** The caller (the Airflow task process, a Slurm job, a CLI)
  holds the other end of the *lifeline*; when it closes (the caller died) or asks, the shim kills the
  tree's PID namespace.
- **A tree never outlives its shim, while the agent lives:** the agent kills a tree whose shim is
  gone (through a pidfd; agent/workloads.py). Not a parent-death signal on the init: CRIU restores
  it, and the restored tree would die with the ``criu restore -d`` that detached it (DESIGN.md: no
  ``--kill-child``).
- **A workload never depends on the agent to live.** The agent's end of the control socket may close
  at any time (a restart, a crash); the workload runs on and its exit still reaches the caller.
- **The workload runs as its caller and no more**: the caller's uid, gid and groups, its cgroups,
  resource limits (never above ours), umask, nice value and an OOM score no lower than its (read by
  the agent: agent/callers.py), a session keyring of its own, the seccomp filter it is given (the
  io_uring filter, run/no_io_uring.py), and its cwd entered as that uid (a directory the caller
  cannot enter fails as it would for the caller); for a caller other than root, an empty capability
  bounding set and ``no_new_privs`` too (setuid programs gain nothing). A root caller's tree is
  root's, as a supervisor's is today. Nothing is executed before the uid changes.

It runs as ``python -I -S shim.py`` with its control socket (``SOCK_SEQPACKET``, to the agent) as
stdin, and imports nothing outside the standard library: it starts in ~20 ms and nothing a caller can
write reaches its ``sys.path``. The first message on the control socket is the spec, with the fds
``[lifeline, stdout, stderr]``::

    {"op": "start", "uid": U, "gid": G, "groups": [...], "argv": [...], "env": {...}, "cwd": "/abs",
     "seccomp": "<struct sock_filter program, hex>" | null, "start_seconds": 8, <the caller's: see below>}
    {"op": "restore", "argv": ["<the agent's criu>", "restore", ..., "-d", ...], "pidfile": "/abs",
     <the caller's>}

where the caller's are ``cgroup_procs``, ``limits``, ``umask``, ``nice`` and ``oom_score_adj``
(callers.py, ``Caller.carried``).

A restore runs the agent's ``criu restore -d`` (never a caller's program) as the shim's child, with the
caller's pipes as its fds 3 and 4; the restored root, detached, becomes the shim's child. The agent
checked the checkpoint and the tree's credentials before, and puts files back and GPU state after.

It says ``{"ev": "started", "pid": P}`` (the namespace init's host pid) to both the agent (with its
pidfd of the tree) and the caller, then ``{"ev": "exit", "code": C, "signal": S | null, "cause": ...}``
once, where code is a shell's (128 + S when signal S ended it) and cause is ``exited``, ``killed`` (asked), ``caller-lost``, ``exec``
(the command did not start: code 127 or 126, and a ``line`` naming why) or ``restore-failed`` (CRIU's
exit code; its log is the agent's to read). The caller may send ``{"op": "kill"}``.
"""

from __future__ import annotations

import array
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

_CLONE_NEWPID = 0x20000000
_PR_SET_SECCOMP, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 22, 24, 36, 38
_SECCOMP_MODE_FILTER = 2
_MAX_MESSAGE = 64 << 10  # protocol.MAX_MESSAGE (this file imports nothing of ours)


def spawn(spec: Mapping[str, Any], lifeline: int, out_w: int,
          err_w: int) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start a shim for ``spec`` (the agent's side): the shim's process and the agent's end of its control
    socket. ``lifeline``, ``out_w`` and ``err_w`` are duplicated into it; the caller of this closes its own."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # Not the agent's environment (its store credentials): the shim and CRIU under it need a PATH only.
        proc = subprocess.Popen([sys.executable, "-I", "-S", __file__], stdin=theirs.fileno(), close_fds=True,
                                env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
    finally:
        theirs.close()
    _send(mine, {"op": "start", **spec}, (lifeline, out_w, err_w))
    return proc, mine


def _send(sock: socket.socket, msg: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    try:
        if fds:
            socket.send_fds(sock, [data], list(fds), socket.MSG_NOSIGNAL)
        else:
            sock.send(data, socket.MSG_NOSIGNAL)
    except OSError:
        pass  # that end is gone: it has nothing more to learn


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and its fds: None at the end only; one that is not a JSON object is ``{}``
    (ignored by every reader here: a caller's garbage ends nothing)."""
    try:  # not socket.recv_fds, which drops MSG_CMSG_CLOEXEC (CPython 3.11): the fds would reach the workload
        data, ancdata, _, _ = sock.recvmsg(_MAX_MESSAGE + 1, socket.CMSG_LEN(4 * 4), socket.MSG_CMSG_CLOEXEC)
    except OSError:
        return None, []
    fds = [fd for level, kind, raw in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
           for fd in array.array("i", raw[: len(raw) - len(raw) % 4])]
    if not data and not fds:
        return None, []
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's depth
        msg = {}
    return (msg if isinstance(msg, dict) else {}), fds


_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(what: str, *args: int) -> None:
    if _libc.prctl(*args, *([0] * (5 - len(args)))) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _become(spec: Mapping[str, Any], out_w: int, err_w: int, report_w: int) -> None:
    """In the namespace's init, from the fork to the exec: become the caller, then the command. Never
    returns; a step that fails is written to ``report_w`` (close-on-exec: its end at the exec says it
    started) and ends the child."""
    step = "a session"
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        _inherit_from_caller(spec)  # still root: into the caller's cgroups, under its limits
        confine = int(spec["uid"]) != 0
        if confine:
            step = "dropping capabilities"
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last = int(f.read())
            for cap in range(last + 1):
                _prctl(step, _PR_CAPBSET_DROP, cap)
        step = "becoming the caller"
        os.setgroups([int(g) for g in spec["groups"]])
        os.setresgid(int(spec["gid"]), int(spec["gid"]), int(spec["gid"]))
        os.setresuid(int(spec["uid"]), int(spec["uid"]), int(spec["uid"]))  # the permitted set goes with uid 0
        step = "a session keyring of its own"
        _own_session_keyring()  # after the uid change: the new keyring is the caller's
        if confine:
            _prctl("no_new_privs", _PR_SET_NO_NEW_PRIVS, 1)
        if spec.get("seccomp"):
            step = "the seccomp filter"
            raw = ctypes.create_string_buffer(bytes.fromhex(spec["seccomp"]))
            prog = _Fprog(len(raw.raw) // 8, ctypes.addressof(raw))
            if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
                err = ctypes.get_errno()
                os.write(2, f"cedana: io_uring is not refused to this workload ({os.strerror(err)}); one it takes "
                            "cannot be checkpointed\n".encode())
        _default_signals()
        step = f"entering {spec['cwd']}"
        os.chdir(spec["cwd"])
        step = str(spec["argv"][0])
        os.execvpe(spec["argv"][0], list(spec["argv"]), dict(spec["env"]))
    except OSError as e:
        code = 127 if e.errno == errno.ENOENT and step == str(spec["argv"][0]) else 126
        os.write(report_w, json.dumps({"code": code, "line": f"{step}: {e.strerror}"}).encode())
    except BaseException as e:  # noqa: BLE001 (a malformed spec): said, never a traceback into the caller's log
        os.write(report_w, json.dumps({"code": 126, "line": f"{step}: {type(e).__name__}: {e}"}).encode())
    os._exit(126)


def _lower(a: int, b: int) -> int:
    """The lower of two limits, where a negative one (the caller's "unlimited") and RLIM_INFINITY are none."""
    inf = resource.RLIM_INFINITY
    a, b = (inf if a < 0 else a), (inf if b < 0 else b)
    return b if a == inf else a if b == inf else min(a, b)


#: keyctl(2)'s system call number per machine (no wrapper in glibc; libkeyutils is not everywhere).
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 280, "ppc64": 280, "s390x": 280,
               "i686": 288, "i386": 288, "armv7l": 311, "armv8l": 311}
_KEYCTL_JOIN_SESSION_KEYRING = 1


def _own_session_keyring() -> None:
    """A new, empty session keyring of the workload's own: otherwise every workload shares the agent's
    (inherited across fork, execve and set*id: session-keyring(7)) and possesses it, so one user's could
    read root's keys there, or plant keys for another user's (the second review's N1)."""
    number = _SYS_KEYCTL.get(os.uname().machine)
    if number is None:
        raise OSError(0, f"a session keyring of its own: no keyctl number known for {os.uname().machine}")
    if _libc.syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"a session keyring of its own: {os.strerror(err)}")


#: What a caller's signals must not do to a shim (a service manager's stop of the agent's unit sends them to
#: every process in it): the shim outlives the agent; its children get them back at their default.
_IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _default_signals() -> None:
    """What the shim (and CPython's start-up) ignored, back to the default: ignored dispositions survive exec."""
    for sig in (*_IGNORED, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)


def _inherit_from_caller(spec: Mapping[str, Any]) -> None:
    """What a process the caller started would have had: its cgroups (so its limits and its job's or
    unit's accounting hold), its resource limits (never above ours), its umask and nice value, and an
    OOM score no lower than its. Raises OSError naming the step."""
    for procs in spec.get("cgroup_procs", ()):
        try:
            with open(procs, "w") as f:
                f.write("0")  # this process
        except OSError as e:
            raise OSError(e.errno, f"joining the caller's cgroup {os.path.dirname(procs)}: {e.strerror}") from None
    for name, (soft, hard) in spec.get("limits", {}).items():
        res = getattr(resource, name, None)
        if res is None:
            continue
        cur_soft, cur_hard = resource.getrlimit(res)
        new_hard = _lower(hard, cur_hard)
        resource.setrlimit(res, (_lower(_lower(soft, cur_soft), new_hard), new_hard))
    if "umask" in spec:
        os.umask(int(spec["umask"]))
    if "nice" in spec:
        os.setpriority(os.PRIO_PROCESS, 0, int(spec["nice"]))
    if "oom_score_adj" in spec:
        with open("/proc/self/oom_score_adj", "r+") as f:
            ours = int(f.read())
            f.seek(0)
            f.write(str(max(ours, int(spec["oom_score_adj"]))))


def _exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> int:
    ctl = socket.socket(fileno=os.dup(0))  # dup: non-inheritable, and fd 0 becomes /dev/null
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    spec, fds = _recv(ctl)
    if spec is None or spec.get("op") not in ("start", "restore") or len(fds) != 3:
        return 2
    lifeline, out_w, err_w = socket.socket(fileno=fds[0]), fds[1], fds[2]
    os.setsid()  # out of the agent's session: what ends the agent does not reach the workload
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    _prctl("becoming a subreaper", _PR_SET_CHILD_SUBREAPER, 1)
    pid = _start(spec, out_w, err_w, lifeline) if spec["op"] == "start" else _restore(spec, out_w, err_w)
    if isinstance(pid, dict):  # it did not start: said once, to both
        _send(lifeline, pid)
        _send(ctl, pid)
        return 0
    started = {"ev": "started", "pid": pid}
    _send(lifeline, started)
    # The agent's handle on the tree: a pidfd opened here, while the tree is our unreaped child (the agent
    # opening one by pid could come after we reaped a command that ended at once: another's pid by then).
    pidfd = os.pidfd_open(pid)
    _send(ctl, started, (pidfd,))
    os.close(pidfd)
    cause = _watch(pid, lifeline, ctl)
    _, status = os.waitpid(pid, 0)
    end = {"ev": "exit", "code": _exit_code(status), "cause": cause,
           "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}
    _send(lifeline, end)
    _send(ctl, end)
    return 0


def _start(spec: Mapping[str, Any], out_w: int, err_w: int, lifeline: socket.socket) -> int | dict[str, Any]:
    """The namespace's init, started as the caller: its pid, or the exit event saying why it did not start.
    One that has not exec'd within ``start_seconds`` (its cwd on a mount that never answers), or whose
    caller goes away meanwhile, is killed."""
    report_r, report_w = os.pipe()  # close-on-exec, as os.pipe makes them
    if _libc.unshare(_CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        return {"ev": "exit", "code": 126, "cause": "exec", "signal": None,
                "line": f"a PID namespace: {os.strerror(err)}"}
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        _become(spec, out_w, err_w, report_w)
    for fd in (report_w, out_w, err_w):
        os.close(fd)
    failed, deadline = b"", time.monotonic() + float(spec.get("start_seconds", 8))
    while True:
        ready = select.select([report_r, lifeline.fileno()], [], [], max(0.0, deadline - time.monotonic()))[0]
        if report_r in ready:
            if not (chunk := os.read(report_r, 65536)):
                break
            failed += chunk
            continue
        why = "its caller went away" if ready else f"it did not start within {float(spec.get('start_seconds', 8)):g} s"
        os.kill(pid, signal.SIGKILL)  # our unreaped child: the pid is still its
        os.waitpid(pid, 0)
        return {"ev": "exit", "code": 126, "cause": "exec", "signal": None,
                "line": f"{why} (a cwd or a command on a mount that does not answer?)"}
    if not failed:
        return pid
    os.waitpid(pid, 0)
    end = {"ev": "exit", "code": 126, "cause": "exec", "signal": None, "line": "the workload did not start"}
    try:
        end.update(json.loads(failed))
    except ValueError:
        pass
    return end


def _restore(spec: Mapping[str, Any], out_w: int, err_w: int) -> int | dict[str, Any]:
    """``criu restore -d`` run as our child, the caller's pipes as its fds 3 and 4 (the agent named them
    so in ``--inherit-fd``): the restored root, detached, becomes our child (we are a subreaper). Its pid
    (from the pidfile), or the exit event of a restore that failed (the agent reads CRIU's log)."""
    pid = os.fork()
    if pid == 0:
        try:
            # The retry's caller's cgroups and limits (CRIU is told to leave cgroups alone: the tree stays
            # in ours), a keyring of its own, the default signals.
            _inherit_from_caller(spec)
            _own_session_keyring()
            _default_signals()
            high_out, high_err = os.dup(out_w), os.dup(err_w)  # out of the way of 3 and 4 first
            os.dup2(high_out, 3)
            os.dup2(high_err, 4)  # dup2's copies are inherited; every other fd here is close-on-exec
            os.execv(spec["argv"][0], list(spec["argv"]))
        except BaseException as e:  # noqa: BLE001
            os.write(2, f"cedana shim: criu did not start: {e}\n".encode())
        os._exit(127)
    os.close(out_w)
    os.close(err_w)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        return {"ev": "exit", "code": _exit_code(status), "cause": "restore-failed", "signal": None}
    try:
        with open(spec["pidfile"]) as f:
            return int(f.read().strip())
    except (OSError, ValueError) as e:
        return {"ev": "exit", "code": 255, "cause": "restore-failed", "signal": None,
                "line": f"criu restore wrote no pid to {spec['pidfile']} ({e})"}


def _watch(pid: int, lifeline: socket.socket, ctl: socket.socket | None) -> str:
    """Until the init ends: its cause. The caller's end closing, or its kill, kills the namespace; the
    agent's end closing is only forgotten."""
    pidfd = os.pidfd_open(pid)
    cause = "exited"
    poll = select.poll()
    for fd in (pidfd, lifeline.fileno(), ctl.fileno() if ctl else -1):
        if fd >= 0:
            poll.register(fd, select.POLLIN)
    while True:
        for fd, _ in poll.poll():
            if fd == pidfd:
                return cause
            if fd == lifeline.fileno():
                msg, extra = _recv(lifeline)
                for x in extra:
                    os.close(x)
                if msg is None or msg.get("op") == "kill":  # anything else from the caller is ignored
                    cause = "killed" if msg is not None else "caller-lost"
                    os.kill(pid, signal.SIGKILL)  # our unreaped child: the pid is still its
                    poll.unregister(lifeline.fileno())
            elif ctl is not None and fd == ctl.fileno():
                msg, extra = _recv(ctl)
                for x in extra:
                    os.close(x)
                if msg is None:  # the agent is gone: the workload is not
                    poll.unregister(ctl.fileno())
                    ctl = None
                elif msg.get("op") == "kill":
                    cause = "killed"
                    os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())

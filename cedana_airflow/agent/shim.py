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
import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

_CLONE_NEWPID, _CLONE_NEWNS, _CLONE_NEWUSER = 0x20000000, 0x00020000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x1, 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
_MNT_DETACH = 2
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


def _become(spec: Mapping[str, Any], out_w: int, err_w: int, report_w: int, own_namespaces: bool = False) -> None:
    """In the namespace's init, from the fork to the exec: become the caller, then the command. Never
    returns; a step that fails is written to ``report_w`` (close-on-exec: its end at the exec says it
    started) and ends the child. ``own_namespaces``: in a tree's own user, mount and PID namespaces
    (:func:`_start_own`), whose creator already joined the caller's cgroups, limits and groups."""
    step = "a session"
    try:
        os.setsid()
        if own_namespaces:
            step = "a /proc of its own"  # CRIU dumps a non-root tree only with one (its parasite reads it)
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        if not own_namespaces:
            _inherit_from_caller(spec)  # still root: into the caller's cgroups, under its limits
        confine = int(spec["uid"]) != 0
        if confine:
            step = "dropping capabilities"
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last = int(f.read())
            for cap in range(last + 1):
                _prctl(step, _PR_CAPBSET_DROP, cap)
        step = "becoming the caller"
        if not own_namespaces:  # there, setgroups would need setgroups=allow for nothing: they are set
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


# --- A tree of its own: user, mount and PID namespaces (a caller other than root) ---------------------------
# CRIU 4.2 dumps a non-root tree in its own PID namespace only when the tree has a /proc of its own (its
# parasite refuses one whose /proc is not the tree's), hence a mount namespace of its own, which only a
# user namespace of its own lets it restore without giving the tree root. The node's mounts go into it as
# childless binds, each its own external mount (agent/trees.py names them at dump; _restore_mounts maps
# them back): CRIU cannot clone a node mount that has children from inside the tree's user namespace (the
# kernel refuses a non-recursive bind of a mount with locked children: fs/namespace.c, __do_loopback).

#: The node's uid (and gid) a tree's user namespace maps its root to: CRIU's restore acts as that root, so
#: it must be mapped, and to nobody of the node's. No process of the tree runs as it (the init becomes the
#: caller before its exec), and its capabilities reach only the tree's own namespaces.
NS_ROOT = 4000000


def id_maps(uid: int, gid: int, groups: Sequence[int]) -> tuple[str, str]:
    """A caller's tree's ``uid_map`` and ``gid_map``: its root to :data:`NS_ROOT`, the caller's uid, gid and
    groups to themselves (so files and groups mean inside what they mean on the node; a group 0 of the
    caller's stays 0, and the tree's root then has it as its group). The same on every node: a restore
    checks an image's maps against them (agent/trees.py). Raises ValueError for an id that is NS_ROOT."""
    gids = sorted({int(gid), *(int(g) for g in groups)})
    if NS_ROOT in (uid, *gids):
        raise ValueError(f"uid or gid {NS_ROOT} is the one trees' root maps to on this node: a caller may not "
                         "have it")
    uid_map = f"0 {NS_ROOT} 1\n{int(uid)} {int(uid)} 1\n"
    gid_map = ("" if 0 in gids else f"0 {NS_ROOT} 1\n") + "".join(f"{g} {g} 1\n" for g in gids)
    return uid_map, gid_map


def _unescape(raw: bytes) -> str:
    """A mountinfo field: the kernel writes space, tab, newline and backslash as ``\\ooo``."""
    out, i = bytearray(), 0
    while i < len(raw):
        if raw[i] == 0x5C and i + 4 <= len(raw) and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return os.fsdecode(bytes(out))


def _nameable(mountpoint: str) -> bool:
    """Whether CRIU's ``--external mnt[KEY]:VAL`` can carry it (the key ends at ``]``, the value after
    ``:``; its options are comma-separated) and our argv can too."""
    return mountpoint.isprintable() and not any(c in mountpoint for c in "[]:, \\")


class Mount(NamedTuple):
    """One line of a mountinfo file (proc(5))."""

    id: int
    mountpoint: str
    fstype: str
    source: str
    options: str  # the file system's own (super) options


def mount_table(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """Every mount listed in ``mountinfo``, in its order."""
    out = []
    with open(mountinfo, "rb") as f:
        for line in f:
            fields = line.split()
            if b"-" in fields[6:]:
                sep = fields.index(b"-", 6)
                more = [_unescape(x) for x in fields[sep + 1:sep + 4]] + ["", "", ""]
                out.append(Mount(int(fields[0]), _unescape(fields[4]), *more[:3]))
    return out


#: The source of the empty mount put over a node mount CRIU cannot name (:func:`_own_mount_tree`): part of
#: the tree, dumped and restored with it (agent/trees.py names no key for it).
MASK_SOURCE = "cedana-mask"


def node_mounts(table: Sequence[Mount]) -> list[str]:
    """The node's mountpoints (of ``table``) a tree may get, each once, parents first: every one but ``/``,
    ``/proc`` and what lies under it (the tree mounts a proc of its own) and a namespace file's
    (``/run/netns/*``: another namespace's handle is none of a workload's business). One whose path CRIU's
    ``--external`` cannot name (:func:`_nameable`) is masked in the tree, not bound."""
    keep = {m.mountpoint for m in table if not _under_proc(m.mountpoint) and m.mountpoint != "/" and m.fstype != "nsfs"}
    return sorted(keep, key=lambda mp: (mp.count("/"), mp))


def _under_proc(mountpoint: str) -> bool:
    return mountpoint == "/proc" or mountpoint.startswith("/proc/")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def b(x: str | None) -> bytes | None:
        return None if x is None else os.fsencode(x)

    if _libc.mount(b(source), b(target), b(fstype), flags, b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting {source or fstype} on {target}: {os.strerror(err)}")


def _staging(staging: str) -> tuple[str, int]:
    """(In a private mount namespace of ours.) A tmpfs on ``staging`` (a root-only folder of the agent's),
    and a childless bind of the node's ``/`` in it: the root to be, and an O_PATH descriptor of it."""
    if _libc.unshare(_CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"a mount namespace: {os.strerror(err)}")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the node, nor the node's here
    # 0755: CRIU opens the binds in it from inside the tree's user namespace, as its root (NS_ROOT); nobody
    # else sees this namespace, and it goes with its process. Neither nosuid nor nodev: CRIU bind-remounts an
    # empty placeholder here to the flags of the mount it stands for, and flags locked by a user namespace
    # cannot be cleared; it only ever holds empty folders and the mounts bound onto them.
    _mount("tmpfs", staging, "tmpfs", 0, "mode=0755")
    root = os.path.join(staging, "root")
    os.mkdir(root, 0o755)
    _mount("/", root, None, _MS_BIND)
    return root, os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


# Every path a caller could have a say in (a folder it may write, on the way to a mountpoint) is opened
# without following a symlink and, where it decides what the tree may see, as the caller; what is bound is
# then that descriptor (/proc/self/fd/N), never the path again: no swap between the look and the bind.
_SYS_OPENAT2 = 437  # the same on every machine (Linux 5.6 added it to the common table)
_AT_FDCWD, _O_PATH = -100, 0o10000000
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _resolve(path: str, dirfd: int = _AT_FDCWD, beneath: bool = False) -> int:
    """An O_PATH descriptor of ``path`` reached without a symlink or a /proc magic link (``beneath``:
    never out of ``dirfd``)."""
    how = _OpenHow(_O_PATH | os.O_CLOEXEC, 0,
                   _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | (_RESOLVE_BENEATH if beneath else 0))
    fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dirfd), os.fsencode(path), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{path}: {os.strerror(err)}")
    return int(fd)


@contextlib.contextmanager
def _as_caller(spec: Mapping[str, Any]) -> Iterator[None]:
    """Look as the caller would: its effective uid, gid and groups. The real and saved ids stay root's, so
    the caller can neither signal nor trace us meanwhile, and root comes back after."""
    groups, egid = os.getgroups(), os.getegid()
    os.setgroups([int(g) for g in spec["groups"]])
    os.setresgid(-1, int(spec["gid"]), -1)
    os.setresuid(-1, int(spec["uid"]), -1)
    try:
        yield
    finally:
        os.setresuid(-1, 0, -1)
        os.setresgid(-1, egid, -1)
        os.setgroups(groups)


def _mount_ids(table: Sequence[Mount]) -> dict[str, set[int]]:
    """{mountpoint: the ids of the mounts on it}."""
    out: dict[str, set[int]] = {}
    for m in table:
        out.setdefault(m.mountpoint, set()).add(m.id)
    return out


def _users_mounts(table: Sequence[Mount]) -> dict[str, int]:
    """{mountpoint: the uid} of FUSE mounts a user other than root made (fusermount's ``user_id=``): over a
    folder of its own, and without allow_other no one else may use it."""
    out: dict[str, int] = {}
    for m in table:
        if m.fstype.startswith("fuse"):
            for opt in m.options.split(","):
                if opt.startswith("user_id=") and opt[8:].isdigit() and int(opt[8:]) != 0:
                    out[m.mountpoint] = int(opt[8:])
    return out


#: What opening a path as the caller may meet that means it cannot reach it (ELOOP: a symlink on the way).
_UNREACHABLE = frozenset({errno.EACCES, errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV})


def _caller_reaches(mountpoint: str, ids: Mapping[str, set[int]], spec: Mapping[str, Any]) -> int | None:
    """A descriptor of the mount on ``mountpoint`` as the caller reaches it (its folders' permissions, no
    symlink), or None: the caller cannot reach it, or the path leads elsewhere than that mount's root."""
    try:
        with _as_caller(spec):
            fd = _resolve(mountpoint)
    except OSError as e:
        if e.errno in _UNREACHABLE:
            return None
        raise OSError(e.errno, f"looking at {mountpoint} as the caller: {os.strerror(e.errno or 0)} (a non-root caller's "
                               "tree needs openat2, Linux 5.6 or later, allowed by any seccomp profile the agent runs "
                               "under)") from None
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            mnt_id = next(int(x.split()[1]) for x in f if x.startswith("mnt_id:"))
        if mnt_id in ids.get(mountpoint, ()) and os.readlink(f"/proc/self/fd/{fd}") == mountpoint:
            return fd
    except (OSError, StopIteration, ValueError):
        pass
    os.close(fd)
    return None


def _own_mount_tree(staging: str, mounts: Sequence[str], spec: Mapping[str, Any]) -> None:
    """(Root, in the process that creates the tree's namespaces.) A root made of childless binds: the
    node's ``/``, ``/proc`` (the kernel lets a user namespace mount a proc only where a full one is
    visible), and each of ``mounts`` (parents first) the caller itself can reach, at its place. One it
    cannot reach is none of its business (and CRIU, restoring as the tree's root, could not find it
    again); one gone meanwhile is left out, as the node shows none either. Then that is our root, and
    nothing else of the node's is reachable."""
    root, rootfd = _staging(staging)
    table = mount_table()  # this namespace's: a new namespace's mounts have new ids
    ids, users = _mount_ids(table), _users_mounts(table)
    _mount("/proc", root + "/proc", None, _MS_BIND)
    for mp in mounts:
        if users.get(mp, int(spec["uid"])) != int(spec["uid"]):
            continue  # another user's FUSE mount, on its own folder: unusable by the caller, and CRIU's root's too
        src = _caller_reaches(mp, ids, spec)
        if src is None:
            continue
        try:
            dst = _resolve(mp.lstrip("/"), rootfd, beneath=True)  # its place in the root to be: no symlink either
        except OSError:
            os.close(src)
            continue
        try:
            if _nameable(mp):
                _mount(f"/proc/self/fd/{src}", f"/proc/self/fd/{dst}", None, _MS_BIND)
            else:  # CRIU's --external cannot name it: an empty mount in its place, so what it hides stays hidden.
                # The caller's (read-only): CRIU restores its root's owner inside the tree's user namespace,
                # where root's is no id at all.
                _mount(MASK_SOURCE, f"/proc/self/fd/{dst}", "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
                       f"mode=0555,size=4k,uid={int(spec['uid'])},gid={int(spec['gid'])}")
        except OSError:
            pass
        finally:
            os.close(src)
            os.close(dst)
    os.close(rootfd)
    os.chdir(root)
    if _libc.syscall(_SYS_PIVOT_ROOT[os.uname().machine], b".", b".") != 0:  # the old root on top, then gone
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    if _libc.umount2(b".", _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"detaching the node's root: {os.strerror(err)}")
    os.chdir("/")


#: pivot_root(2)'s system call number per machine (no wrapper in glibc).
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217,
                   "i686": 217, "i386": 217, "armv7l": 218, "armv8l": 218}


def _start_own(spec: Mapping[str, Any], staging: str, out_w: int, err_w: int, report_r: int, report_w: int,
               deadline: float) -> int | None:
    """Start the tree in user, mount and PID namespaces of its own (a caller other than root): a helper
    builds its mounts (:func:`_own_mount_tree`), joins the caller's cgroups, limits and groups as root,
    creates the namespaces, waits for us to write their id maps (only a process outside them may map
    ids other than its own), forks the init and exits; the init, ours by then (a subreaper), becomes the
    caller. Its host pid, or None where the helper failed (``report_r`` says why)."""
    uid_map, gid_map = id_maps(int(spec["uid"]), int(spec["gid"]), spec["groups"])
    mounts = node_mounts(mount_table())
    ask_r, ask_w = os.pipe()
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        step = "a mount tree of its own"
        try:
            for fd in (report_r, ask_r, go_w):
                os.close(fd)
            _own_mount_tree(staging, mounts, spec)
            step = "the caller's cgroups and limits"
            _inherit_from_caller(spec)
            step = "the caller's groups"
            os.setgroups([int(g) for g in spec["groups"]])
            step = "user, mount and PID namespaces"
            if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            os.write(ask_w, b"?")
            if os.read(go_r, 1) != b"!":
                os._exit(126)  # the shim gave up on us: it says why
            init = os.fork()
            if init == 0:
                _become(spec, out_w, err_w, report_w, own_namespaces=True)
            os.write(ask_w, str(init).encode())
            os._exit(0)
        except BaseException as e:  # noqa: BLE001
            why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            os.write(report_w, json.dumps({"code": 126, "line": f"{step}: {why}"}).encode())
            os._exit(126)
    os.close(ask_w)
    os.close(go_r)
    try:
        if _read_by(ask_r, deadline) != b"?":
            return None
        for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
            with open(f"/proc/{helper}/{name}", "w") as f:
                f.write(text)
        os.write(go_w, b"!")
        got = _read_by(ask_r, deadline)
        return int(got) if got.isdigit() else None
    finally:
        os.close(ask_r)
        os.close(go_w)
        if not _reaped_by(helper, deadline):  # stuck on a mount that does not answer
            os.kill(helper, signal.SIGKILL)
            os.waitpid(helper, 0)
            os.write(report_w, json.dumps({"code": 126, "line": "its mounts were not ready in time (a mount of the "
                                                                 "node's that does not answer?)"}).encode())


def _read_by(fd: int, deadline: float) -> bytes:
    """One read of ``fd`` once it is readable, or b"" at the deadline."""
    if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        return b""
    return os.read(fd, 64)


def _reaped_by(pid: int, deadline: float) -> bool:
    while True:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def _restore_mounts(staging: str, keys: Sequence[str], image_mounts: set[str], spec: Mapping[str, Any]) -> list[str]:
    """(In the process that becomes ``criu restore``, as root.) CRIU's own private mount namespace for a
    tree in its own namespaces, and CRIU's options for it:

    - a childless bind of ``/``: the tree's root (``--root``);
    - for each of the image's external mounts' ``keys`` (their mountpoints), a childless bind of this
      node's mount there, where the caller reaches it as it is (:func:`_caller_reaches`), else an empty
      folder, bound by CRIU with the dumped mount's flags: a tree that held files there then fails to
      restore on them;
    - nothing under ``/proc``: the tree's view of the node's proc must be childless too.

    The tree's mountpoints must be folders on this node (CRIU mounts on them). Raises OSError where this
    node mounts, within the caller's reach, a folder the image (``image_mounts``: every mountpoint it
    holds) has no mount on, and the caller could list files beneath that mount in the view the tree
    gets (the nearest mount the image names, or the root): restored here, the tree would see what that
    mount hides. CRIU makes the tree's mounts from these and exits, and this namespace goes with it."""
    before = mount_table()  # the node's, before the staging mounts join it
    under_proc = [m.mountpoint for m in before if m.mountpoint.startswith("/proc/")]
    node = node_mounts(before)
    root, rootfd = _staging(staging)
    table = mount_table()  # this namespace's: a new namespace's mounts have new ids
    ids, users = _mount_ids(table), _users_mounts(table)
    options = ["--root", root, "--ext-mount-map", "auto"]
    views: dict[str, str] = {"/": root}  # what the tree will see at a mountpoint, childless: where to look
    for i, key in enumerate(keys):
        if _under_proc(key) or not key.startswith("/") or not _nameable(key):
            continue  # found by CRIU itself (--ext-mount-map auto), or none of ours
        dest = os.path.join(staging, str(i))
        src = None
        if key in node and users.get(key, int(spec["uid"])) == int(spec["uid"]):
            src = _caller_reaches(key, ids, spec)
        is_dir = True
        if src is not None:
            try:
                with _as_caller(spec):  # not as root: a FUSE mount refuses root
                    is_dir = stat.S_ISDIR(os.fstat(src).st_mode)
            except OSError:
                os.close(src)
                src = None
        if is_dir:
            os.mkdir(dest)
        else:
            os.close(os.open(dest, os.O_CREAT | os.O_WRONLY, 0o644))  # a file's mount
        if src is not None:
            try:
                _mount(f"/proc/self/fd/{src}", dest, None, _MS_BIND)
                views[key] = dest
            finally:
                os.close(src)
        options += ["--external", f"mnt[{key}]:{dest}"]
    for mp in node:
        if mp in image_mounts or users.get(mp, 0) != 0:
            continue  # the image mounts there; or another user's FUSE mount, over a folder of that user's
        if (fd := _caller_reaches(mp, ids, spec)) is None:
            continue
        os.close(fd)
        if _hides_from(views, mp, spec):
            raise OSError(0, f"this node mounts {mp}, which the checkpoint's tree had no mount on, and the folder "
                             f"beneath that mount holds files the tree would see; restore it on a node like the one "
                             f"it ran on, or empty {mp}'s folder beneath the mount")
    os.close(rootfd)
    for mp in sorted(under_proc, key=lambda m: -m.count("/")):
        _libc.umount2(os.fsencode(mp), _MNT_DETACH)
    return options


def _hides_from(views: Mapping[str, str], mp: str, spec: Mapping[str, Any]) -> bool:
    """Whether the caller could list something at ``mp`` in the tree's view: beneath the nearest mount the
    tree gets there (``views``: mountpoint -> a childless copy of it), what this node's mount at ``mp``
    hides. Looked at as the caller (its permissions are the tree's), without following a symlink."""
    near = max((v for v in views if v == "/" or mp == v or mp.startswith(v.rstrip("/") + "/")), key=len)
    rel = mp[len(near):].lstrip("/")
    base = os.open(views[near], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with _as_caller(spec):
            try:
                fd = _resolve(rel, base, beneath=True) if rel else os.dup(base)
            except OSError:
                return False  # no such folder there, or the caller cannot reach it: nothing to see
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    return bool(os.listdir(f"/proc/self/fd/{fd}"))
                return st.st_size > 0
            except OSError:
                return False  # the caller may not list it: nor may the tree
            finally:
                os.close(fd)
    finally:
        os.close(base)


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
    listener = _listen(str(spec.get("control") or ""))
    mine = os.stat(str(spec["control"])).st_ino if listener is not None else None
    _tell_agent(ctl, pid)
    try:
        cause, agent = _watch(pid, lifeline, ctl, listener)
        _, status = os.waitpid(pid, 0)
        end = {"ev": "exit", "code": _exit_code(status), "cause": cause,
               "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}
        _send(lifeline, end)
        if agent is not None:
            _send(agent, end)
    finally:
        with contextlib.suppress(OSError):  # ours only: a later shim of the same workload may listen there now
            if mine is not None and os.stat(str(spec["control"])).st_ino == mine:
                os.unlink(str(spec["control"]))
    return 0


def _tell_agent(ctl: socket.socket, pid: int) -> None:
    """``started``, with the agent's handle on the tree: a pidfd opened here, while the tree is our unreaped
    child (an agent opening one by pid could come after we reaped a command that ended at once: another's
    pid by then)."""
    pidfd = os.pidfd_open(pid)
    _send(ctl, {"ev": "started", "pid": pid}, (pidfd,))
    os.close(pidfd)


def _listen(path: str) -> socket.socket | None:
    """Where an agent started after ours (a restart) takes the tree up again: a socket in the agent's
    root-only runs folder (``control``); None where the agent gave none."""
    if not path:
        return None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(4)
    except OSError:
        listener.close()
        return None  # the tree runs on; only a restarted agent cannot take it up
    return listener


def _start(spec: Mapping[str, Any], out_w: int, err_w: int, lifeline: socket.socket) -> int | dict[str, Any]:
    """The namespace's init, started as the caller: its pid, or the exit event saying why it did not start.
    One that has not exec'd within ``start_seconds`` (its cwd on a mount that never answers), or whose
    caller goes away meanwhile, is killed."""
    report_r, report_w = os.pipe()  # close-on-exec, as os.pipe makes them
    deadline = time.monotonic() + float(spec.get("start_seconds", 8))
    pid: int | None
    if spec.get("own_mounts"):
        try:
            pid = _start_own(spec, str(spec["own_mounts"]), out_w, err_w, report_r, report_w, deadline)
        except (OSError, ValueError) as e:  # ValueError: an id the tree's root maps to (id_maps)
            pid = None
            os.write(report_w, json.dumps({"code": 126, "line": str(e)}).encode())
    else:
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
    failed = b""
    while True:
        ready = select.select([report_r, lifeline.fileno()], [], [], max(0.0, deadline - time.monotonic()))[0]
        if report_r in ready:
            if not (chunk := os.read(report_r, 65536)):
                break
            failed += chunk
            continue
        why = "its caller went away" if ready else f"it did not start within {float(spec.get('start_seconds', 8)):g} s"
        if pid is not None:
            os.kill(pid, signal.SIGKILL)  # our unreaped child: the pid is still its
            os.waitpid(pid, 0)
        return {"ev": "exit", "code": 126, "cause": "exec", "signal": None,
                "line": f"{why} (a cwd or a command on a mount that does not answer?)"}
    if not failed and pid is not None:
        return pid
    if pid is not None:
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
    report_r, report_w = os.pipe()  # close-on-exec: CRIU never sees it
    pid = os.fork()
    if pid == 0:
        try:
            # The retry's caller's cgroups and limits (CRIU is told to leave cgroups alone: the tree stays
            # in ours), a keyring of its own, the default signals.
            argv = list(spec["argv"])
            if spec.get("own_mounts"):  # a tree in its own namespaces (its images hold a user namespace)
                argv += _restore_mounts(str(spec["own_mounts"]), [str(k) for k in spec.get("external_mounts", ())],
                                        {str(m) for m in spec.get("image_mounts", ())}, spec)
            _inherit_from_caller(spec)  # after the mounts: the caller's limits (its open files) bind CRIU only
            _own_session_keyring()
            _default_signals()
            high_out, high_err = os.dup(out_w), os.dup(err_w)  # out of the way of 3 and 4 first
            os.dup2(high_out, 3)
            os.dup2(high_err, 4)  # dup2's copies are inherited; every other fd here is close-on-exec
            os.execv(argv[0], argv)
        except BaseException as e:  # noqa: BLE001
            why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            os.write(report_w, f"criu restore did not start: {why}".encode())
        os._exit(127)
    os.close(out_w)
    os.close(err_w)
    os.close(report_w)
    _, status = os.waitpid(pid, 0)
    line = os.read(report_r, 4096).decode(errors="replace")
    os.close(report_r)
    if status != 0:
        return {"ev": "exit", "code": _exit_code(status), "cause": "restore-failed", "signal": None, "line": line}
    try:
        with open(spec["pidfile"]) as f:
            return int(f.read().strip())
    except (OSError, ValueError) as e:
        return {"ev": "exit", "code": 255, "cause": "restore-failed", "signal": None,
                "line": f"criu restore wrote no pid to {spec['pidfile']} ({e})"}


def _watch(pid: int, lifeline: socket.socket, ctl: socket.socket | None,
           listener: socket.socket | None) -> tuple[str, socket.socket | None]:
    """Until the init ends: its cause, and the agent's end then (None while no agent holds one). The
    caller's end closing, or its kill, kills the namespace; the agent's end closing is only forgotten,
    and an agent that connects to ``listener`` as root (a restarted one) is the agent from then on."""
    pidfd = os.pidfd_open(pid)
    cause = "exited"
    poll = select.poll()
    for fd in (pidfd, lifeline.fileno(), ctl.fileno() if ctl else -1, listener.fileno() if listener else -1):
        if fd >= 0:
            poll.register(fd, select.POLLIN)
    while True:
        for fd, _ in poll.poll():
            if fd == pidfd:
                return cause, ctl
            if fd == lifeline.fileno():
                msg, extra = _recv(lifeline)
                for x in extra:
                    os.close(x)
                if msg is None or msg.get("op") == "kill":  # anything else from the caller is ignored
                    cause = "killed" if msg is not None else "caller-lost"
                    os.kill(pid, signal.SIGKILL)  # our unreaped child: the pid is still its
                    poll.unregister(lifeline.fileno())
            elif listener is not None and fd == listener.fileno():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                if uid != 0 or ctl is not None:  # root's alone; and one agent at a time (a live one keeps it)
                    conn.close()
                    continue
                ctl = conn
                poll.register(ctl.fileno(), select.POLLIN)
                _tell_agent(ctl, pid)
            elif ctl is not None and fd == ctl.fileno():
                msg, extra = _recv(ctl)
                for x in extra:
                    os.close(x)
                if msg is None:  # the agent is gone: the workload is not
                    poll.unregister(ctl.fileno())
                    ctl.close()
                    ctl = None
                elif msg.get("op") == "kill":
                    cause = "killed"
                    os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())

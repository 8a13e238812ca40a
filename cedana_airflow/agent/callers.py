"""What the agent knows of a caller beyond its uid, and what a caller's workload inherits from it.

A workload the agent starts is the child of a root shim, so by default it would inherit the shim's
namespaces, cgroups, limits and capabilities, not its caller's: a caller in a container or a systemd
sandbox would get its workload out of it, and a root caller stripped of its capabilities would get
them back. So the agent reads the caller (through a pidfd of the very process that connected, so a
reused pid is never read) and:

- refuses a caller in namespaces other than the agent's (a container, a sandbox), in a chroot, or
  under a seccomp filter: carrying a workload into them is not built yet;
- refuses a root caller that is confined (fewer capabilities than the agent, ``no_new_privs``): its
  workload would be full root;
- carries the rest over into the workload (shim.py applies it before the uid changes): the caller's
  cgroups, resource limits, umask and nice value, and an OOM score no lower than the caller's.
"""

from __future__ import annotations

import errno
import os
import re
import select
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import errors
from .protocol import Peer

__all__ = ["Caller", "read_caller"]

_SO_PEERPIDFD = 77  # asm-generic/socket.h, Linux 6.5: a pidfd of the process that connected
_NAMESPACES = ("mnt", "net", "pid", "user", "ipc", "uts", "cgroup")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
#: /proc/PID/limits' names for the resources setrlimit knows (resource(2)'s RLIMIT_* in that order).
_LIMITS = {
    "Max cpu time": "RLIMIT_CPU", "Max file size": "RLIMIT_FSIZE", "Max data size": "RLIMIT_DATA",
    "Max stack size": "RLIMIT_STACK", "Max core file size": "RLIMIT_CORE", "Max resident set": "RLIMIT_RSS",
    "Max processes": "RLIMIT_NPROC", "Max open files": "RLIMIT_NOFILE", "Max locked memory": "RLIMIT_MEMLOCK",
    "Max address space": "RLIMIT_AS", "Max file locks": "RLIMIT_LOCKS", "Max pending signals": "RLIMIT_SIGPENDING",
    "Max msgqueue size": "RLIMIT_MSGQUEUE", "Max nice priority": "RLIMIT_NICE",
    "Max realtime priority": "RLIMIT_RTPRIO", "Max realtime timeout": "RLIMIT_RTTIME",
}


@dataclass(frozen=True)
class Caller:
    """A connected caller as the kernel shows it, read at connect and again for each of its messages."""

    peer: Peer
    namespaces: dict[str, str]
    root: tuple[int, int]  # (st_dev, st_ino) of its root directory: a chroot is not a namespace
    cap_bnd: int
    cap_prm: int
    cap_eff: int
    no_new_privs: bool
    seccomp: int  # /proc/PID/status Seccomp: 0 none, 1 strict, 2 filter
    cgroup_procs: tuple[str, ...]  # each hierarchy's cgroup.procs the workload joins
    limits: dict[str, tuple[int, int]]  # RLIMIT_* name -> (soft, hard); -1: unlimited
    umask: int
    nice: int
    oom_score_adj: int

    def refusal(self, agent: Caller) -> str:
        """Why the agent may not start a workload for this caller ("" where it may)."""
        other = [n for n in _NAMESPACES if self.namespaces.get(n) != agent.namespaces.get(n)]
        if other:
            return (f"{self.peer} is in another {other[0]} namespace than the agent (a container or a sandbox); "
                    "its workload would leave it, and carrying a workload into a caller's namespaces is not built "
                    "yet. Call the agent from the node's own namespaces")
        if self.root != agent.root:
            return (f"{self.peer} runs in a chroot; its workload would leave it, and carrying a workload into one is "
                    "not built yet. Call the agent from the node's own root")
        if self.seccomp:  # any filter: one equal in kind to an agent's own may still be stricter (review 49, F4)
            return (f"{self.peer} runs under a seccomp filter; its workload would not, and carrying a caller's "
                    "filters is not built yet. Call the agent from a process without one")
        if self.peer.uid == 0 and ((self.cap_bnd, self.cap_prm, self.cap_eff) != (agent.cap_bnd, agent.cap_prm,
                                                                                  agent.cap_eff) or self.no_new_privs):
            return (f"{self.peer} is root with fewer capabilities than the agent or no_new_privs set; its workload "
                    "would be full root. Run the task as a user other than root")
        return ""

    @classmethod
    def remembered(cls, peer: Peer, carried: dict[str, Any]) -> Caller:
        """The caller of a workload a former agent started (agent/remembered.py): who it was and what its
        workload carries; nothing else of it is read again (it may be gone, and its checks were passed)."""
        return cls(peer, {}, (0, 0), 0, 0, 0, False, 0, tuple(carried.get("cgroup_procs", ())),
                   {k: (int(v[0]), int(v[1])) for k, v in carried.get("limits", {}).items()},
                   int(carried.get("umask", 0o022)), int(carried.get("nice", 0)), int(carried.get("oom_score_adj", 0)))

    def carried(self) -> dict[str, Any]:
        """What the shim gives the workload from its caller (shim.py's spec)."""
        return {"cgroup_procs": list(self.cgroup_procs), "limits": {k: list(v) for k, v in self.limits.items()},
                "umask": self.umask, "nice": self.nice, "oom_score_adj": self.oom_score_adj}


def read_caller(conn: socket.socket, peer: Peer) -> Caller:
    """The caller at the other end of ``conn`` (an accepted connection). Raises Refused where it cannot be
    read as the process that connected (it is gone, or its pid is someone else's now)."""
    try:
        pidfd = int.from_bytes(conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, 4), "little", signed=True)
    except OSError as e:
        if e.errno != errno.ENOPROTOOPT:  # the connector is gone (6.5 to 6.15 say so for a reaped one)
            raise errors.Refused(f"{peer} is gone ({e.strerror}): nothing to act for") from None
        # Before Linux 6.5: the pid as it is now, checked against the connector's uid below.
        try:
            pidfd = os.pidfd_open(peer.pid)
        except OSError as e:
            raise errors.Refused(f"{peer} is gone ({e.strerror}): nothing to act for") from None
    try:
        caller = _read(peer.pid, peer)
        if select.select([pidfd], [], [], 0)[0]:  # it exited while we read: what we read may be another's
            raise errors.Refused(f"{peer} exited while the agent read it: nothing to act for")
        return caller
    finally:
        os.close(pidfd)


def read_self() -> Caller:
    """The agent itself, in the same terms: what a caller is compared with."""
    me = Peer(os.getpid(), os.getuid(), os.getgid(), tuple(os.getgroups()))
    return _read(me.pid, me)


def _status(proc: Path) -> dict[str, str]:
    """/proc/PID/status (or a thread's) as its fields. Bytes, split on newlines only (text mode and
    splitlines break lines at "\r" too: a process names itself, and its name is the status's first line)."""
    text = (proc / "status").read_bytes().decode(errors="surrogateescape")
    return dict(line.split(":\t", 1) for line in text.split("\n") if ":\t" in line)


def _read(pid: int, peer: Peer) -> Caller:
    proc = Path(f"/proc/{pid}")
    try:
        status = _status(proc)
        if int(status["Uid"].split()[0]) != peer.uid:
            raise errors.Refused(f"{peer} is gone (pid {pid} is another user's process now): nothing to act for")
        namespaces = {n: os.readlink(proc / "ns" / n) for n in _NAMESPACES}
        stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        root = os.stat(proc / "root")
        c = _Confinement.of(status)
        for task in sorted((proc / "task").iterdir()):  # each thread's own: a message may come from any of them
            if task.name != str(pid):
                c = c.with_thread(task, namespaces, (root.st_dev, root.st_ino))
        root_id = (root.st_dev, root.st_ino) if c.root is None else c.root
        return Caller(peer=peer, namespaces=c.namespaces or namespaces, root=root_id,
                      cap_bnd=c.cap_bnd, cap_prm=c.cap_prm, cap_eff=c.cap_eff, no_new_privs=c.no_new_privs,
                      seccomp=c.seccomp,
                      cgroup_procs=_cgroup_procs((proc / "cgroup").read_bytes().decode(errors="surrogateescape")),
                      limits=_limits((proc / "limits").read_text()),
                      umask=int(status.get("Umask", "0022"), 8), nice=int(stat[16]),
                      oom_score_adj=int((proc / "oom_score_adj").read_text()))
    except (OSError, KeyError, ValueError, IndexError) as e:
        raise errors.Refused(f"{peer} could not be read ({type(e).__name__}: {e}): nothing to act for") from None


@dataclass(frozen=True)
class _Confinement:
    """What confines a process, taken over all its threads: seccomp, no_new_privs and capabilities are
    each thread's own, and a thread may setns or chroot alone. A message's sender is a process, never a
    thread (SCM_CREDENTIALS), so the most confined thread stands for it, and threads in namespaces or
    roots of their own make it stand nowhere the agent is (review 49, R2). Not a boundary, and not meant as
    one: threads share memory, so a process is as strong as its least confined thread, and a confined
    thread that sent and then ended is not seen (third review, T1); what this catches is a process that
    confined one of its threads and meant that thread's work to stay confined."""

    cap_bnd: int
    cap_prm: int
    cap_eff: int
    no_new_privs: bool
    seccomp: int
    namespaces: dict[str, str] | None = None  # where a thread's differ: marked mixed, never the agent's
    root: tuple[int, int] | None = None  # (-1, -1) where a thread's root differs

    @classmethod
    def of(cls, status: dict[str, str]) -> _Confinement:
        return cls(int(status["CapBnd"], 16), int(status["CapPrm"], 16), int(status["CapEff"], 16),
                   status.get("NoNewPrivs", "0").strip() == "1", int(status.get("Seccomp", "0")))

    def with_thread(self, task: Path, main_ns: dict[str, str], main_root: tuple[int, int]) -> _Confinement:
        """This, and what confines the thread ``task`` (/proc/PID/task/TID) too."""
        try:
            t = _Confinement.of(_status(task))
            ns = {n: os.readlink(task / "ns" / n) for n in _NAMESPACES}
            st = os.stat(task / "root")
        except (FileNotFoundError, ProcessLookupError, PermissionError):  # one that ended as we read (ESRCH or,
            return self  # for its ns links, EACCES): only a task that is gone is unreadable to root here
        mixed = {n: f"threads in {main_ns[n]} and {ns[n]}" for n in _NAMESPACES if ns[n] != main_ns[n]}
        root = (st.st_dev, st.st_ino)
        return _Confinement(self.cap_bnd & t.cap_bnd, self.cap_prm & t.cap_prm, self.cap_eff & t.cap_eff,
                            self.no_new_privs or t.no_new_privs, max(self.seccomp, t.seccomp),
                            {**main_ns, **(self.namespaces or {}), **mixed} if mixed else self.namespaces,
                            (-1, -1) if root != main_root else self.root)


def _cgroup_procs(text: str) -> tuple[str, ...]:
    """Each hierarchy's ``cgroup.procs`` for /proc/PID/cgroup's lines (v1 ``id:controllers:/path``, v2
    ``0::/path``), read as bytes (text mode would turn a ``\r`` into a newline). Split on newlines only:
    the kernel refuses only ``\n`` in a cgroup's name, so a caller who names its own cgroups could end a
    line with ``\r`` anywhere else. A line that does not parse, or a
    cgroup that is not there, refuses the caller: its workload must not land anywhere but in its cgroups."""
    out = []
    for line in text.split("\n"):
        if not line:
            continue
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/") or ".." in parts[2].split("/"):
            raise ValueError(f"a line of its /proc/PID/cgroup does not parse: {line[:80]!r}")
        _, controllers, path = parts
        folder = controllers.removeprefix("name=") if controllers else ""
        base = _CGROUP_ROOT / folder if folder else (_CGROUP_ROOT / "unified" if (_CGROUP_ROOT / "unified").is_dir()
                                                      else _CGROUP_ROOT)
        procs = base / path.lstrip("/") / "cgroup.procs"
        if not procs.exists() and folder and "," in folder:  # a co-mounted pair under a joined name: cpu,cpuacct
            procs = _CGROUP_ROOT / folder.split(",")[0] / path.lstrip("/") / "cgroup.procs"
        if not procs.exists():
            raise ValueError(f"its cgroup {controllers}:{path[:80]!r} is not at {procs.parent}")
        out.append(str(procs))
    return tuple(out)


_LIMIT_LINE = re.compile(r"^(?P<name>Max [a-z ]+?)\s{2,}(?P<soft>\S+)\s+(?P<hard>\S+)")


def _limits(text: str) -> dict[str, tuple[int, int]]:
    out = {}
    for line in text.splitlines()[1:]:
        m = _LIMIT_LINE.match(line)
        if m and m["name"] in _LIMITS:
            soft, hard = (-1 if v == "unlimited" else int(v) for v in (m["soft"], m["hard"]))
            out[_LIMITS[m["name"]]] = (soft, hard)
    return out


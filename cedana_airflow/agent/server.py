"""The node agent's server: callers connect to a unix socket; the kernel says who each one is; the agent
starts workloads as that caller (agent/shim.py) and acts for a caller only on what it started.

Authorization, per request:

- ``start`` runs the workload as the peer's uid, gid and groups (``SO_PEERCRED``), never as anything a
  request names.
- An op on a workload needs the peer's uid to be the workload's **and** the handle the agent gave at
  its start (compared in constant time), or a root peer. The uid is the boundary; the handle keeps
  two tasks of one uid (every task of a Celery worker) from acting on each other's workloads by
  mistake, and is never listed.
- Every request is one JSON line in the audit log (peer, op, workload, decision), refusals a WARNING
  too; never an environment, an argument past argv[0], or a handle.

Ops (protocol.py has the framing): ``hello``, ``start`` (fds: the workload's stdout and stderr; the
reply carries the caller's end of the lifeline), ``status``, ``kill``, ``list``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .. import __version__, errors
from ..fsafe import UnsafePath, secure_base
from ..run.no_io_uring import filter_program
from . import protocol, shim
from .protocol import Peer

__all__ = ["Agent", "DEFAULT_SOCKET"]

log = logging.getLogger(__name__)

#: Where callers find the agent (a 0755 root folder: anyone may connect; what they may do is per op).
DEFAULT_SOCKET = Path("/run/cedana-airflow/agent.sock")
#: How long a shim has to say its workload started (today's _child_of waits as long).
START_SECONDS = 10.0


class _Start(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields a newer client adds are ignored (protocol.py)

    argv: list[str] = Field(min_length=1)
    cwd: str
    env: dict[str, str] = {}
    deny_io_uring: bool = True

    @field_validator("cwd")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return v


class _Target(BaseModel):
    model_config = ConfigDict(extra="ignore")

    wid: str
    handle: str


@dataclass
class _Workload:
    wid: str
    uid: int
    handle: str
    pid: int
    argv0: str
    shim: Any  # subprocess.Popen[bytes]
    ctl: socket.socket
    started: float = field(default_factory=time.time)
    code: int | None = None
    cause: str = ""
    ended: threading.Event = field(default_factory=threading.Event)

    def public(self) -> dict[str, Any]:
        """What its owner may see (never the handle)."""
        return {"wid": self.wid, "uid": self.uid, "pid": self.pid, "argv0": self.argv0, "started": self.started,
                "state": "ended" if self.ended.is_set() else "running", "code": self.code, "cause": self.cause}


class Agent:
    """One per node. :meth:`serve` until :meth:`close`."""

    def __init__(self, socket_path: Path = DEFAULT_SOCKET, *, node: str, audit: Path | None = None) -> None:
        self.socket_path = socket_path
        self.node = node
        self._audit_path = audit
        self._lock = threading.Lock()
        self._workloads: dict[str, _Workload] = {}
        self._closing = threading.Event()
        self._listener = self._bind(socket_path)
        self._ops: Mapping[str, Callable[[Peer, dict[str, Any], list[int]], tuple[dict[str, Any], list[int]]]] = {
            "hello": self._hello, "start": self._start, "status": self._status, "kill": self._kill, "list": self._list}

    @staticmethod
    def _bind(path: Path) -> socket.socket:
        """The listening socket, in a folder only root may write (so nobody can put another in its place)."""
        try:
            os.close(secure_base(path.parent, mode=0o755))
        except UnsafePath as e:
            raise errors.ConfigError(f"agent socket folder {path.parent} is unsafe: {e}. Give the agent a "
                                     "folder only root can write (the default: /run/cedana-airflow)") from None
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise errors.ConfigError(f"agent socket {path} exists and is not a socket. Remove it or choose "
                                         "another path")
            os.unlink(path)  # a dead agent's: connecting to it would fail anyway
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(str(path))
        os.chmod(path, 0o666)  # anyone local may ask; what they may do is decided per op
        sock.listen(64)
        return sock

    # -- serving ------------------------------------------------------------------------------------

    def serve(self) -> None:
        log.info("agent serving on %s node=%s", self.socket_path, self.node)
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closing.is_set():
                    return
                raise
            threading.Thread(target=self._connection, args=(conn,), name="cedana-agent-conn", daemon=True).start()

    def close(self) -> None:
        """Stop accepting; running workloads are left to their shims (they never depend on the agent)."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        with self._lock:
            for w in self._workloads.values():
                w.ctl.close()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            peer = Peer.of(conn)
            while True:
                try:
                    msg, fds = protocol.recv(conn)
                except errors.Refused as e:
                    self._audit(peer, {"op": "?"}, str(e))
                    protocol.send(conn, protocol.error_reply(None, e))
                    continue
                except OSError:
                    return
                if msg is None:
                    return
                reply, out_fds = self._answer(peer, msg, fds)
                try:
                    protocol.send(conn, reply, out_fds)
                except OSError:
                    return
                finally:
                    protocol.close_fds(out_fds)

    def _answer(self, peer: Peer, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        req_id = msg.get("id")
        op = self._ops.get(str(msg.get("op")))
        try:
            try:
                if op is None:
                    raise errors.Refused(f"unknown op {str(msg.get('op'))[:40]!r}: this agent ({__version__}) knows "
                                         f"{', '.join(sorted(self._ops))}. Upgrade the agent or the client")
                reply, out_fds = op(peer, msg, fds)
            finally:
                protocol.close_fds(fds)  # what an op keeps, it has duplicated
        except errors.CedanaError as e:
            self._audit(peer, msg, str(e))
            return protocol.error_reply(req_id, e), []
        self._audit(peer, msg, "")
        return {"id": req_id, "ok": True, **reply}, out_fds

    def _audit(self, peer: Peer, msg: Mapping[str, Any], refused: str) -> None:
        row = {"time": round(time.time(), 3), "pid": peer.pid, "uid": peer.uid, "gid": peer.gid,
               "op": str(msg.get("op"))[:40], "wid": msg.get("wid"),
               "decision": f"refused: {refused}" if refused else "allowed"}
        if msg.get("op") == "start" and isinstance(msg.get("argv"), list) and msg["argv"]:
            row["argv0"] = str(msg["argv"][0])[:200]
        if refused:
            log.warning("agent refused %s to %s: %s", row["op"], peer, refused)
        if self._audit_path is not None:
            fd = os.open(self._audit_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, (json.dumps(row) + "\n").encode())
            finally:
                os.close(fd)

    # -- ops ----------------------------------------------------------------------------------------

    def _hello(self, peer: Peer, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        return {"proto": protocol.PROTO, "agent": __version__, "node": self.node, "ready": True,
                "features": ["start"], "you": {"uid": peer.uid, "gid": peer.gid}}, []

    def _start(self, peer: Peer, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        req = _parsed(_Start, msg, "start")
        if len(fds) != 2:
            raise errors.Refused(f"start needs the workload's stdout and stderr as 2 fds, got {len(fds)}. "
                                 "Use the agent client")
        seccomp = filter_program() if req.deny_io_uring else None
        spec = {"uid": peer.uid, "gid": peer.gid, "groups": list(peer.groups), "argv": req.argv, "cwd": req.cwd,
                "env": req.env, "seccomp": seccomp.hex() if seccomp else None}
        caller_end, shim_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc, ctl = shim.spawn(spec, shim_end.fileno(), fds[0], fds[1])
        except OSError as e:
            caller_end.close()
            raise errors.EngineUnavailable(f"the agent could not start a shim: {e}. Check the agent's log") from None
        finally:
            shim_end.close()
        first = _first_event(ctl, START_SECONDS)
        if first.get("ev") != "started":
            caller_end.close()
            ctl.close()
            proc.wait()
            line = str(first.get("line") or f"the shim ended without starting it ({first})")
            if first.get("code") == 127:
                raise errors.CommandNotFound(f"cannot start the workload: {line}. Check the command and PATH")
            raise errors.Refused(f"cannot start the workload as {peer}: {line}")
        w = _Workload(wid=f"w-{secrets.token_hex(6)}", uid=peer.uid, handle=secrets.token_hex(16),
                      pid=int(first["pid"]), argv0=req.argv[0], shim=proc, ctl=ctl)
        with self._lock:
            self._workloads[w.wid] = w
        threading.Thread(target=self._follow, args=(w,), name=f"cedana-agent-{w.wid}", daemon=True).start()
        log.info("agent started %s for %s pid=%d argv0=%s", w.wid, peer, w.pid, w.argv0)
        try:
            return {"wid": w.wid, "handle": w.handle, "pid": w.pid, "node": self.node}, [caller_end.detach()]
        finally:
            caller_end.close()

    def _status(self, peer: Peer, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        return self._owned(peer, msg).public(), []

    def _kill(self, peer: Peer, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        w = self._owned(peer, msg)
        if not w.ended.is_set():
            w.ctl.send(json.dumps({"op": "kill"}).encode(), socket.MSG_NOSIGNAL)
            w.ended.wait(10)
        return w.public(), []

    def _list(self, peer: Peer, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            mine = [w.public() for w in self._workloads.values() if peer.uid == 0 or w.uid == peer.uid]
        return {"workloads": mine}, []

    def _owned(self, peer: Peer, msg: dict[str, Any]) -> _Workload:
        t = _parsed(_Target, msg, str(msg.get("op")))
        with self._lock:
            w = self._workloads.get(t.wid)
        if w is None:
            raise errors.Refused(f"no workload {t.wid[:40]!r} on node {self.node}. List yours with the list op")
        if peer.uid != 0 and w.uid != peer.uid:
            raise errors.Refused(f"workload {w.wid} belongs to uid {w.uid}, not to {peer}")
        if peer.uid != 0 and not hmac.compare_digest(t.handle.encode(), w.handle.encode()):
            raise errors.Refused(f"workload {w.wid}: that is not its handle. Use the handle its start returned")
        return w

    def _follow(self, w: _Workload) -> None:
        """The shim's events until its workload ends (the agent's copy; the caller has its own)."""
        for ev in _events(w.ctl):
            if ev.get("ev") == "exit":
                w.code, w.cause = int(ev.get("code", 255)), str(ev.get("cause", ""))
                break
        else:
            w.cause = w.cause or "shim-lost"
        w.ended.set()
        w.shim.wait()
        log.info("agent: %s ended code=%s cause=%s", w.wid, w.code, w.cause)


def _parsed(model: type[BaseModel], msg: Mapping[str, Any], op: str) -> Any:
    try:
        return model.model_validate(msg)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or op
        raise errors.Refused(f"{op}: {where} {err['msg'].removeprefix('Value error, ')}. Fix the request") from None


def _events(ctl: socket.socket) -> Iterator[dict[str, Any]]:
    while True:
        try:
            msg, fds = protocol.recv(ctl)
        except (OSError, errors.Refused):
            return
        protocol.close_fds(fds)
        if msg is None:
            return
        yield msg


def _first_event(ctl: socket.socket, timeout: float) -> dict[str, Any]:
    ctl.settimeout(timeout)
    try:
        msg, fds = protocol.recv(ctl)
        protocol.close_fds(fds)
        return msg if msg is not None else {"line": "the shim ended without a word"}
    except TimeoutError:
        return {"line": f"no word from the shim in {timeout:.0f} s"}
    except (OSError, errors.Refused) as e:
        return {"line": f"the shim's first word was unreadable ({e})"}
    finally:
        ctl.settimeout(None)

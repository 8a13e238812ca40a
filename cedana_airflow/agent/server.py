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

Ops (protocol.py has the framing): ``hello``; ``start`` (fds: the workload's stdout and stderr; the
reply carries the caller's end of the lifeline), which runs it as run/runner.py runs a workload, with
heartbeat checkpoints signed by the node's key into the node's store (workloads.py); ``status``;
``stop`` (the final checkpoint, then the end); ``kill`` (no checkpoint); ``list``. A start with
``resume`` restores the ID's newest checkpoint first (CRIU under the tree's shim, in full).
``checkpoints`` (0.8.4) answers what the caller may know of the store's checkpoints (views.py), and
``drill`` (0.8.4) runs a fleet drill of the node's for agent_drillers (drill/).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import hmac
import json
import logging
import os
import queue
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .. import __version__, errors
from ..config import Settings, load_settings, printable
from ..errors import ConfigError
from ..format.manifest import AirflowTask
from ..fsafe import UnsafePath, secure_base
from ..ids import validate_checkpoint_id
from ..signal_safe import SignalSafeEvent
from . import protocol
from .callers import Caller, read_caller, read_self
from .protocol import Peer, Sender
from . import DEFAULT_SOCKET
from .remembered import recall
from .views import MAX_DETAILED, MAX_IDS, Viewer, checkpoint_rows, valid_ids
from .workloads import Run, task_settings

__all__ = ["Agent", "DEFAULT_SOCKET"]

log = logging.getLogger(__name__)

#: How long an ended run stays for its owner's ``status``, and how many of one uid's at most (the newest).
KEEP_ENDED_SECONDS = 600.0
KEEP_ENDED_PER_UID = 64
#: Connections one uid may hold open at once, and all callers together: each is a thread and an fd of
#: the agent, so the caps keep one user from using them all up (the agent must outlast any caller).
MAX_CONNECTIONS_PER_UID = 16
MAX_CONNECTIONS = 256
#: Workloads one uid other than root may have running at once: each is a root shim and two agent
#: threads, which count against no limit of the caller's.
MAX_RUNS_PER_UID = 32
#: Refusals of one uid written one by one in a minute (the rest are counted, and said in one row).
REFUSALS_PER_MINUTE = 50
#: Messages that are not requests, in a row, after which a connection is closed.
GARBAGE_IN_A_ROW = 10
#: How long the accept loop waits before it looks at a stop again (serve).
ACCEPT_SECONDS = 0.5
#: A connection that sends nothing for this long is closed (a caller connects again for its next request).
IDLE_SECONDS = 300.0
_WID = re.compile(r"^w-[0-9a-f]{12}$")


class _Refuser:
    """Closes refused connections after their callers could read why: one thread for all of them.

    Closing a unix socket with a message of its caller's still unread resets the connection, and the
    caller then reads ECONNRESET instead of the refusal queued for it (af_unix.c, unix_release_sock). So
    a refused connection is kept a moment, its callers' messages drained, then closed, in one thread
    with a bounded queue: a flood of refused connections costs neither threads nor the accept loop's
    time (past the queue they are closed at once)."""

    KEEP_SECONDS = 1.0

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[socket.socket, float]] = queue.Queue(maxsize=64)
        threading.Thread(target=self._run, name="cedana-agent-refuser", daemon=True).start()

    def refuse(self, conn: socket.socket, reply: Mapping[str, Any]) -> None:
        with contextlib.suppress(OSError):
            protocol.send(conn, reply)
        conn.setblocking(False)
        try:
            self._queue.put_nowait((conn, time.monotonic() + self.KEEP_SECONDS))
        except queue.Full:
            conn.close()

    def _run(self) -> None:
        held: list[tuple[socket.socket, float]] = []
        while True:
            try:
                held.append(self._queue.get(timeout=0.1 if held else None))
            except queue.Empty:
                pass
            now, kept = time.monotonic(), []
            for conn, until in held:
                try:
                    while conn.recv(protocol.MAX_MESSAGE + 1):  # drained: its close resets nothing
                        pass
                    done = True  # an empty read: the caller closed its end
                except BlockingIOError:
                    done = now >= until
                except OSError:
                    done = True
                if done:
                    conn.close()
                else:
                    kept.append((conn, until))
            held = kept


def _pipefs_dev() -> int:
    r, w = os.pipe()
    try:
        return os.fstat(r).st_dev
    finally:
        os.close(r)
        os.close(w)


_PIPEFS = _pipefs_dev()


def _not_callers_pipe(fd: int, uid: int) -> str:
    """Why ``fd`` is not the write end of an anonymous pipe ``uid`` made ("" where it is). A restore gives
    these to ``criu restore --inherit-fd``, which reopens them with the flags the image recorded, through
    CRIU's usernsd (root) where the tree may not: any other fd (an O_PATH of a root-only file, a named
    FIFO) would come back to the tree opened by root (review 49, F1)."""
    try:
        st, flags = os.fstat(fd), fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        return f"it cannot be examined: {e.strerror}"
    if flags & os.O_PATH:
        return "an O_PATH descriptor"
    if not stat.S_ISFIFO(st.st_mode) or st.st_dev != _PIPEFS:
        return "not an anonymous pipe"
    if flags & os.O_ACCMODE != os.O_WRONLY:
        return "not open for writing only"
    if st.st_uid != uid:
        return f"made by uid {st.st_uid}"
    return ""


def _sender_refusal(peer: Peer, sender: Sender | None) -> errors.Refused | None:
    """Why a message's sender may not use this connection (None where it may): the connection is its
    opener's alone. SO_PEERCRED is the connector's, so a socket handed on, or kept across a change of uid, is
    not its sender's to use (unix(7)); and one handed to another process of the same uid (a child that then
    confined itself, say) would be judged by its opener's confinement (review 49, F4)."""
    if sender is None or (sender.uid, sender.gid) != (peer.uid, peer.gid):
        who = f"uid {sender.uid} (pid {sender.pid})" if sender else "a sender the kernel did not name"
        return errors.Refused(f"this connection was opened by {peer}; a message from {who} on it is refused. Connect "
                              "after the last change of uid, and do not hand the connection on")
    if sender.pid != peer.pid:
        return errors.Refused(f"this connection was opened by {peer}; a message from pid {sender.pid} on it is "
                              "refused. Connect from the process that sends, and do not hand the connection on")
    return None


class _Start(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields a newer client adds are ignored (protocol.py)

    checkpoint_id: str
    restore_only: bool = False  # 0.8.2: no command; restore the newest checkpoint (none: refused), as `restore`
    argv: list[str] = []  # (after restore_only: its validator reads it)
    cwd: str
    env: dict[str, str] = {}
    try_number: int = Field(ge=0, default=0)
    settings: dict[str, Any] = {}
    claim: AirflowTask | None = None  # the Airflow task it says it is: signed into its manifests, never proof
    resume: bool = False  # restore the ID's newest checkpoint when there is one (a retry), else start fresh

    @field_validator("argv")
    @classmethod
    def _a_command(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if not v and not info.data.get("restore_only"):
            raise ValueError("List should have at least 1 item after validation, not 0 (or restore_only)")
        return v

    @field_validator("cwd")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return v


class _Checkpoints(BaseModel):
    model_config = ConfigDict(extra="ignore")

    ids: list[str] | None = Field(default=None, max_length=MAX_IDS)  # None: every ID the caller may see, paged
    after: str = ""  # without ids: the page after this ID (the last reply's ``next``)
    detail: bool = False  # with ids: the writer lease and the newest restore records too


class _VerifyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: str = Field(default="*", max_length=200)
    sample: int = Field(default=10, ge=1, le=1000)
    seed: int | None = None


class _CanaryParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mb: int = Field(default=64, ge=1, le=4096)
    steps: int = Field(default=60, ge=1, le=100_000)
    step_seconds: float = Field(default=0.1, ge=0.001, le=60, allow_inf_nan=False)
    heartbeat: float = Field(default=1.0, gt=0, le=3600, allow_inf_nan=False)
    heartbeats: int = Field(default=2, ge=1, le=100)
    timeout: float = Field(default=600, gt=0, le=3600, allow_inf_nan=False)


class _Drill(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: Literal["verify", "canary", "keep"]  # keep: a live drill's report, which its task ran (drill/live.py)
    params: dict[str, Any] = {}


_LIVE_DRILL_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-live-[0-9a-f]{6}")  # fullmatch
#: IDs one page of "every ID" reads (its reply also stops at views.REPLY_BYTES), and how long the store's
#: listing serves the pages after it.
PAGE_IDS = 32
LISTING_SECONDS = 30.0
#: The largest drill report the agent reads or writes (it travels in a memfd, not in a message).
REPORT_BYTES = 16 << 20


class _Target(BaseModel):
    model_config = ConfigDict(extra="ignore")

    wid: str
    handle: str
    said_since: int = Field(default=0, ge=0)  # status: the run's lines after this one (0.8.3)


class Agent:
    """One per node. :meth:`serve` until :meth:`close`."""

    def __init__(self, socket_path: Path = DEFAULT_SOCKET, *, environ: Mapping[str, str],
                 audit: Path | None = None) -> None:
        """``environ``: the agent's own environment, where its node settings come from (CEDANA_*,
        CEDANA_CONFIG): the store, the key, CRIU, the work dir."""
        self._environ = dict(environ)
        self.settings = load_settings(environ=self._environ)  # a bad node setting stops the agent here
        self.node = self.settings.resolved_node()
        self._readers = group_ids(self.settings.agent_readers, "agent_readers")
        self._drillers = group_ids(self.settings.agent_drillers, "agent_drillers")
        self._drilling = threading.Lock()  # one drill at a time on a node (a canary is a whole workload)
        self._listing: tuple[float, list[str]] = (0.0, [])  # the store's IDs, for the pages of "every ID"
        self._store_client: Any = None  # the checkpoints op's (_store)
        self.socket_path = socket_path
        self._audit_path = audit
        self._lock = threading.Lock()
        self._runs: dict[str, Run] = {}
        self._closing = SignalSafeEvent()  # close() runs in SIGTERM's and SIGINT's handlers
        self._listener = self._bind(socket_path)
        # Where shims build the mounts of trees in namespaces of their own: each mounts a tmpfs on it in a
        # private mount namespace, so one empty folder serves them all; root's only.
        self.staging = socket_path.parent / "mounts"
        os.close(secure_base(self.staging, mode=0o700))
        self.runs_dir = socket_path.parent / "runs"  # what a former agent left running (remembered.py)
        os.close(secure_base(self.runs_dir, mode=0o700))
        self.coop = coop_base(self.settings, socket_path)
        self._take_up()
        self._connections: dict[int, int] = {}  # uid -> connections open
        self._starting: dict[int, int] = {}  # uid -> starts under way (counted with its running workloads)
        self._starting_ids: list[tuple[str, int]] = []  # (checkpoint ID, uid) of each start under way
        self._refusals: dict[int, tuple[float, int, int]] = {}  # uid -> (minute's start, refusals, not written)
        self._pending_rows: list[Mapping[str, Any]] = []
        self._audit_broken = ""  # why the audit log could not be written last time ("" while it can)
        self._refuser = _Refuser()
        self._self = read_self()  # what a caller's namespaces and bounds are compared with
        self._ops: Mapping[str, Callable[[Caller, dict[str, Any], list[int]], tuple[dict[str, Any], list[int]]]] = {
            "hello": self._hello, "start": self._start, "status": self._status, "stop": self._stop, "kill": self._kill,
            "list": self._list, "checkpoints": self._checkpoints, "drill": self._drill}

    def _take_up(self) -> None:
        """Take up what a former agent left running (its runs folder): their heartbeats go on from here."""
        for r in recall(self.runs_dir):
            try:
                settings = task_settings(self._environ, r.settings, bounded=False)
                run = Run.take_up(r, settings, node=self.node, staging=self.staging, runs=self.runs_dir, coop=self.coop)
            except Exception as e:  # noqa: BLE001 (a setting gone bad, another version's file: said, never fatal)
                log.warning("agent: %s (checkpoint_id=%s) not taken up: %s", r.wid, r.checkpoint_id, e)
                continue
            if run is None:
                log.info("agent: %s (checkpoint_id=%s) ended while no agent ran", r.wid, r.checkpoint_id)
                continue
            self._runs[run.wid] = run
            log.info("agent took up %s of uid %d checkpoint_id=%s pid=%d", run.wid, run.uid, run.checkpoint_id, r.pid)

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
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                try:
                    probe.connect(str(path))
                except OSError:
                    pass  # a dead agent's: nobody answers there
                else:
                    raise errors.ConfigError(f"another agent answers at {path}. Stop it first, or give this one "
                                             "another --socket")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # On the listener, so every accepted connection has it from its first message on (accept(2)
        # copies it): set on the connection after accept, a message sent in between would come without.
        protocol.pass_credentials(sock)
        sock.bind(str(path))
        os.chmod(path, 0o666)  # anyone local may ask; what they may do is decided per op
        sock.listen(64)
        return sock

    # -- serving ------------------------------------------------------------------------------------

    def serve(self) -> None:
        """Accept callers until :meth:`close`. Nothing a caller does ends this loop: a refused or failed
        accept is said and the next one goes on (a flood of connections costs the flooder, not the node)."""
        log.info("agent serving on %s node=%s", self.socket_path, self.node)
        # A stop's signal may be delivered to any of our threads, and Python runs its handler only in this one,
        # between two calls: an accept that waits for ever would never see it (a SIGTERM left the agent running
        # until the next caller came). So the wait is short, and the loop looks again.
        self._listener.settimeout(ACCEPT_SECONDS)
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closing.is_set():
                    return
                log.warning("agent: accepting a caller failed (%s); going on", e.strerror or e)
                time.sleep(0.1)  # out of fds or memory: give the connections that hold them time to end
                continue
            try:
                self._admit(conn)
            except Exception:  # noqa: BLE001 (a bug here must not take the node's agent down)
                log.exception("agent: a connection failed before it was served")
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        """A connection's own thread, within the per-uid and total caps; else one line and closed."""
        try:
            peer = Peer.of(conn)
        except (OSError, errors.Refused) as e:
            log.warning("agent: a caller could not be identified (%s); closed", e)
            conn.close()
            return
        with self._lock:
            mine, total = self._connections.get(peer.uid, 0), sum(self._connections.values())
            full = (f"{peer} already holds {mine} connections to the agent, at most {MAX_CONNECTIONS_PER_UID}"
                    if mine >= MAX_CONNECTIONS_PER_UID else
                    f"the agent holds {total} connections, at most {MAX_CONNECTIONS}" if total >= MAX_CONNECTIONS
                    else "")
            if not full:
                self._connections[peer.uid] = mine + 1
        if not full:
            try:
                threading.Thread(target=self._connection, args=(conn, peer), name="cedana-agent-conn",
                                 daemon=True).start()
                return
            except RuntimeError:  # the agent's thread or task limit
                self._release(peer)
                full = "the agent cannot start another thread now (its task limit)"
        refusal = errors.Refused(f"{full}. Close idle connections, or try again later")
        self._audit(peer, {"op": "connect"}, str(refusal))
        self._refuser.refuse(conn, protocol.error_reply(None, refusal))

    def _release(self, peer: Peer) -> None:
        with self._lock:
            self._connections[peer.uid] -= 1
            if not self._connections[peer.uid]:
                del self._connections[peer.uid]

    def close(self) -> None:
        """Stop accepting; running workloads are left to their shims (they never depend on the agent)."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def _connection(self, conn: socket.socket, peer: Peer) -> None:
        try:
            with conn:
                conn.settimeout(IDLE_SECONDS)  # an idle caller's connection is closed; it reconnects
                try:
                    caller = read_caller(conn, peer)
                except errors.Refused as e:
                    self._audit(peer, {"op": "connect"}, str(e))
                    protocol.send(conn, protocol.error_reply(None, e))
                    return
                self._serve_caller(conn, caller)
        except OSError:
            return  # the caller went away mid-answer, or idled out
        finally:
            self._release(peer)

    def _serve_caller(self, conn: socket.socket, caller: Caller) -> None:
        peer = caller.peer
        garbage = 0
        while True:
            try:
                msg, fds, sender = protocol.recv_from(conn)
            except errors.Refused as e:
                self._audit(peer, {"op": "?"}, str(e))
                protocol.send(conn, protocol.error_reply(None, e))
                garbage += 1
                if garbage >= GARBAGE_IN_A_ROW:  # a client this confused is not helped by more answers
                    return
                continue
            garbage = 0
            if msg is None:
                return
            refusal = _sender_refusal(peer, sender)
            if refusal is None:
                try:  # read again for each message: a process may confine itself after it connected (F4)
                    caller = read_caller(conn, peer)
                except errors.Refused as e:
                    refusal = e
            if refusal is not None:  # one line, and the connection ends
                protocol.close_fds(fds)
                self._audit(peer, msg, str(refusal))
                protocol.send(conn, protocol.error_reply(msg.get("id"), refusal))
                return
            reply, out_fds = self._answer(caller, msg, fds)
            try:
                protocol.send(conn, reply, out_fds)
            except errors.Refused as e:  # a reply past the protocol's size: said, not a dropped connection
                log.warning("agent could not send a %s reply to %s: %s", protocol.printable(str(msg.get("op")), 40),
                            peer, e)
                protocol.send(conn, protocol.error_reply(msg.get("id"), e))
            finally:
                protocol.close_fds(out_fds)

    def _answer(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        peer = caller.peer
        req_id = msg.get("id")
        op = self._ops.get(str(msg.get("op")))
        try:
            try:
                if op is None:
                    raise errors.Refused(f"unknown op {str(msg.get('op'))[:40]!r}: this agent ({__version__}) knows "
                                         f"{', '.join(sorted(self._ops))}. Upgrade the agent or the client")
                reply, out_fds = op(caller, msg, fds)
            finally:
                protocol.close_fds(fds)  # what an op keeps, it has duplicated
        except errors.CedanaError as e:
            self._audit(peer, msg, str(e))
            return protocol.error_reply(req_id, e), []
        self._audit(peer, msg, "")
        return {"id": req_id, "ok": True, **reply}, out_fds

    def _audit(self, peer: Peer, msg: Mapping[str, Any], refused: str) -> None:
        """One row per request. What a caller sent is cut short and kept printable (a row, or a log line,
        is never a caller's to forge or to inflate): a wid only in the shape the agent gives them. Past
        :data:`REFUSALS_PER_MINUTE` refusals of one uid in a minute, the rest are counted, and said in one
        row when the minute is over. Never raises: a row that cannot be written is said in the log, and
        starts are refused until one can (:meth:`_start`)."""
        if refused and not self._refusal_counted(peer):
            return
        wid = msg.get("wid")
        row = {"time": round(time.time(), 3), "pid": peer.pid, "uid": peer.uid, "gid": peer.gid,
               "op": protocol.printable(str(msg.get("op")), 40),
               "wid": wid if isinstance(wid, str) and _WID.match(wid) else (None if wid is None else "?"),
               "decision": f"refused: {protocol.printable(refused)}" if refused else "allowed"}
        if msg.get("op") == "start" and isinstance(msg.get("argv"), list) and msg["argv"]:
            row["argv0"] = protocol.printable(str(msg["argv"][0]), 200)
        if refused:
            log.warning("agent refused %s to %s: %s", row["op"], peer, protocol.printable(refused))
        self._write_row(row)

    def _refusal_counted(self, peer: Peer) -> bool:
        """Whether this refusal of ``peer``'s uid gets its own row (else it is counted for the summary)."""
        now = time.monotonic()
        with self._lock:
            start, count, dropped = self._refusals.get(peer.uid, (now, 0, 0))
            if now - start >= 60:
                if dropped:
                    summary = {"time": round(time.time(), 3), "uid": peer.uid, "op": "*",
                               "decision": f"refused {dropped} more times in that minute (not written one by one)"}
                    log.warning("agent refused uid %d %d more times in a minute (not logged one by one)", peer.uid,
                                dropped)
                    self._pending_rows.append(summary)
                start, count, dropped = now, 0, 0
            count += 1
            keep = count <= REFUSALS_PER_MINUTE
            self._refusals[peer.uid] = (start, count, dropped + (not keep))
        return keep

    def _write_row(self, row: Mapping[str, Any]) -> None:
        with self._lock:
            rows, self._pending_rows = [*self._pending_rows, row], []
        if self._audit_path is None:
            return
        try:
            fd = os.open(self._audit_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, "a short write")
            finally:
                os.close(fd)
        except OSError as e:
            if not self._audit_broken:
                log.error("agent: the audit log %s cannot be written (%s); starts are refused until it can",
                          self._audit_path, e.strerror or e)
            self._audit_broken = e.strerror or str(e)
        else:
            self._audit_broken = ""

    # -- ops ----------------------------------------------------------------------------------------

    def _hello(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        peer = caller.peer
        out = {"proto": protocol.PROTO, "agent": __version__, "node": self.node, "ready": True,
               "features": ["start", "heartbeat", "stop", "restore", "said", "checkpoints", "drill", "cooperative"],
               # restore: start's restore_only (0.8.2); said: status's lines (0.8.3); checkpoints, drill: the ops,
               # cooperative: a start's mode and cooperative settings (0.8.4)
               "you": {"uid": peer.uid, "gid": peer.gid},
               # 0.8.4: whose checkpoints the checkpoints op shows this caller (agent_readers, views.py)
               "sees": "every" if self._viewer(caller).sees_all else "own",
               "drills": self._may_drill(caller) == "",
               "protected": True}  # every caller's workload is checkpointed (one other than root's: shim.py)
        return out, []

    def _start(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        peer = caller.peer
        req = _parsed(_Start, msg, "start")
        if len(fds) != 2:
            raise errors.Refused(f"start needs the workload's stdout and stderr as 2 fds, got {len(fds)}. "
                                 "Use the agent client")
        for name, fd in zip(("stdout", "stderr"), fds):
            if why := _not_callers_pipe(fd, peer.uid):
                raise errors.Refused(f"start: the workload's {name} must be the write end of a pipe the caller made "
                                     f"({why}). Use the agent client")
        validate_checkpoint_id(req.checkpoint_id)
        if why := caller.refusal(self._self):
            raise errors.Refused(why)
        settings = task_settings(self._environ, req.settings)
        if self._audit_path is not None and self._audit_broken:
            raise errors.Refused(f"the agent's audit log {self._audit_path} cannot be written ({self._audit_broken}); "
                                 "no workload starts until it can. Free its disk")
        self._forget_ended()
        with self._lock:  # a start under way counts already: concurrent starts cannot pass the cap together
            running = sum(1 for r in self._runs.values() if r.uid == peer.uid and not r.ended)
            running += self._starting.get(peer.uid, 0)
            users = {r.uid for r in self._runs.values() if r.checkpoint_id == req.checkpoint_id and not r.ended}
            users |= {uid for cid, uid in self._starting_ids if cid == req.checkpoint_id}  # a start under way too
            if peer.uid != 0 and users - {peer.uid}:
                raise errors.Refused(f"checkpoint ID {req.checkpoint_id} is in use by another uid's workload on this "
                                     "node. Give this task its own checkpoint_id")
            if peer.uid != 0 and running >= MAX_RUNS_PER_UID:
                raise errors.Refused(f"{peer} already has {running} workloads running under the agent, at most "
                                     f"{MAX_RUNS_PER_UID}. Stop one first")
            self._starting[peer.uid] = self._starting.get(peer.uid, 0) + 1
            self._starting_ids.append((req.checkpoint_id, peer.uid))
        try:
            run = Run(caller, settings, req.checkpoint_id, node=self.node, staging=self.staging, runs=self.runs_dir,
                      coop=self.coop,
                      requested=req.settings)
            run.begin(None if req.restore_only else req.argv, cwd=req.cwd, env=req.env, try_number=req.try_number,
                      claim=req.claim, out_w=fds[0], err_w=fds[1], resume=req.resume)
            with self._lock:
                self._runs[run.wid] = run
        finally:
            with self._lock:
                self._starting[peer.uid] -= 1
                self._starting_ids.remove((req.checkpoint_id, peer.uid))
        assert run.workload is not None and run.lifeline is not None
        log.info("agent started %s for %s checkpoint_id=%s pid=%d", run.wid, peer, run.checkpoint_id, run.workload.pid)
        lifeline, run.lifeline = run.lifeline.detach(), None  # the caller's from now: sent, then closed here
        return {"wid": run.wid, "handle": run.handle, "pid": run.workload.pid, "node": self.node,
                "restored_seq": run.restored_seq, "fresh": run.fresh}, [lifeline]

    def _status(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        since = _parsed(_Target, msg, "status").said_since
        return self._owned(caller, msg).public(since), []

    def _stop(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """A clean cut, as SIGTERM to a supervisor: the final checkpoint, then the tree's end (run/stop.py)."""
        run = self._owned(caller, msg)
        run.stop.set()
        run.wait(run.settings.stop_window_seconds + 30)
        return run.public(), []

    def _kill(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        run = self._owned(caller, msg)
        run.kill()
        run.wait(30)
        return run.public(), []

    def _list(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        every = self._trusted_root(caller)
        with self._lock:
            mine = [r.public() for r in self._runs.values() if every or r.uid == caller.peer.uid]
        return {"workloads": mine}, []

    def _trusted_root(self, caller: Caller) -> bool:
        """Root the agent would start workloads for: it may list, stop and kill any uid's. Root it refuses
        (in a container, a chroot, under seccomp, with fewer capabilities) is uid 0 and no more: its own
        workloads, by their handles (review 49, F3)."""
        return caller.peer.uid == 0 and not caller.refusal(self._self)

    def _viewer(self, caller: Caller) -> Viewer:
        """Root the agent would start workloads for (not one in a container or with fewer capabilities), and
        members of agent_readers and agent_drillers, see every ID; anyone else its own uid's."""
        peer = caller.peer
        groups = {peer.gid, *peer.groups}
        return Viewer(peer, self._trusted_root(caller) or bool(groups & (self._readers | self._drillers)))

    def _may_drill(self, caller: Caller) -> str:
        """Why this caller may not have the agent run drills ("" where it may): root the agent trusts, or
        a member of agent_drillers."""
        peer = caller.peer
        if peer.uid == 0:
            why = caller.refusal(self._self)
            return f"drills are not run for it: {why}" if why else ""
        if {peer.gid, *peer.groups} & self._drillers:
            return ""
        return (f"{peer} may not run drills through the agent: they read every checkpoint of the node's store and "
                "run as root. Add its group to the node's agent_drillers")

    def _checkpoints(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """The store's facts the caller may see (views.py): the IDs it names, or (a caller that sees every ID)
        a page of every ID."""
        req = _parsed(_Checkpoints, msg, "checkpoints")
        viewer = self._viewer(caller)
        if req.ids is not None:
            for cid in req.ids:
                validate_checkpoint_id(cid)
        elif not viewer.sees_all:
            raise errors.Refused(f"checkpoints: {caller.peer} sees only its own uid's checkpoints, so it names the IDs "
                                 "it asks about (ids). Listing every ID is for the node's agent_readers")
        if req.detail and not (req.ids and len(req.ids) <= MAX_DETAILED):
            raise errors.Refused(f"checkpoints: detail is given for at most {MAX_DETAILED} ID a request names. "
                                 "Name it in ids")
        from ..keys import node_trust
        from ..store import FileStore

        store = self._store()
        if isinstance(store, FileStore) and not store.root.exists():
            return {"rows": [], "next": "", "rest": []}, []  # a file store appears with its first checkpoint
        store.open(create=False, chunk_avg_bytes=self.settings.chunk_avg_bytes)
        trust = node_trust(self.settings)
        if req.ids is not None:
            rows, rest = checkpoint_rows(store, trust, viewer, req.ids, detail=req.detail)
            return {"rows": rows, "next": "", "rest": rest}, []
        # every ID, in ID order: a page of at most PAGE_IDS IDs, and of what fits a reply
        later = [c for c in self._store_ids(store, fresh=not req.after) if c > req.after]
        page = later[:PAGE_IDS]
        rows, rest = checkpoint_rows(store, trust, viewer, page)
        if rest:
            nxt = page[page.index(rest[0]) - 1]
        else:
            nxt = page[-1] if len(later) > PAGE_IDS else ""
        return {"rows": rows, "next": nxt, "rest": []}, []

    def _store_ids(self, store: Any, fresh: bool) -> list[str]:
        """The store's checkpoint IDs, sorted: read again for a listing's first page, else kept a while (its
        next pages), so that a walk of N IDs lists the store once, not N/PAGE_IDS times."""
        with self._lock:
            at, ids = self._listing
        if fresh or time.monotonic() - at > LISTING_SECONDS:
            ids = sorted(valid_ids(store.list_ids()))
            with self._lock:
                self._listing = (time.monotonic(), ids)
        return ids

    def _drill(self, caller: Caller, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """A drill of the node's (drill/), for root and agent_drillers only, one at a time: ``verify`` and
        ``canary`` run here, with the node's store, key and CRIU, and their report is kept and returned (in a
        memfd: a report may be larger than a message); ``keep`` keeps the report of a live drill its caller
        ran (it fails and clears tasks through Airflow's API, which the agent has no access to), sent the
        same way."""
        req = _parsed(_Drill, msg, "drill")
        if why := self._may_drill(caller):
            raise errors.Refused(why)
        from ..drill.report import DrillReport, save_report
        from ..drill.run import run_drill

        if req.mode == "keep":
            if len(fds) != 1:
                raise errors.Refused("drill keep: send the live drill's report as one fd (a memfd). Use the agent "
                                     "client")
            try:
                report = DrillReport.model_validate_json(_read_fd(fds[0], REPORT_BYTES))
            except (ValidationError, ValueError) as e:
                raise errors.Refused(f"drill keep: the report is not one: {protocol.printable(str(e), 200)}. "
                                     "Send a live drill's report") from None
            if report.mode != "live" or not _LIVE_DRILL_ID.fullmatch(report.drill_id):
                raise errors.Refused("drill keep: only a live drill's report (its drill_id as new_drill_id makes "
                                     "it) is kept this way; the agent runs the other drills itself")
            store = self._store()
            store.open(create=True, chunk_avg_bytes=self.settings.chunk_avg_bytes)
            return {"kept": save_report(store, report)}, []
        model = _VerifyParams if req.mode == "verify" else _CanaryParams
        params = _parsed(model, req.params, f"drill {req.mode}").model_dump()
        if not self._drilling.acquire(blocking=False):
            raise errors.Refused("a drill runs on this node now; one runs at a time. Try again when it has ended")
        try:
            store = self._store()
            cfg = store.open(create=True, chunk_avg_bytes=self.settings.chunk_avg_bytes)
            report = run_drill(req.mode, store, cfg, self.settings, **params)
        except errors.CedanaError:
            raise
        except Exception as e:  # noqa: BLE001 (a canary's subprocess, say: one line, not a dead connection)
            log.exception("agent: drill %s failed", req.mode)
            raise errors.CedanaError(f"the {req.mode} drill failed in the agent: {type(e).__name__}: "
                                     f"{protocol.printable(str(e), 300)}. Check the agent's log") from None
        finally:
            self._drilling.release()
        data = report.model_dump_json().encode()
        return {"drill_id": report.drill_id, "passed": report.ok, "report_bytes": len(data)}, [_memfd(data, "report")]

    def _store(self) -> Any:
        """The node's store, one client for every query (a boto3 client is thread-safe, and slow to make)."""
        from ..store import open_store

        with self._lock:
            if self._store_client is None:
                self._store_client = open_store(self.settings.resolved_store(), self.settings)
            return self._store_client

    def _owned(self, caller: Caller, msg: dict[str, Any]) -> Run:
        peer, root = caller.peer, self._trusted_root(caller)
        t = _parsed(_Target, msg, protocol.printable(str(msg.get("op")), 40))
        with self._lock:
            run = self._runs.get(t.wid)
        if run is None:
            raise errors.Refused(f"no workload {t.wid[:40]!r} on node {self.node}. List yours with the list op")
        if not root and run.uid != peer.uid:
            raise errors.Refused(f"workload {run.wid} belongs to uid {run.uid}, not to {peer}")
        if not root and not hmac.compare_digest(t.handle.encode(), run.handle.encode()):
            raise errors.Refused(f"workload {run.wid}: that is not its handle. Use the handle its start returned")
        return run

    def _forget_ended(self) -> None:
        cutoff = time.time() - KEEP_ENDED_SECONDS
        with self._lock:
            ended = sorted((r for r in self._runs.values() if r.ended_at is not None), key=lambda r: -(r.ended_at or 0))
            kept: dict[int, int] = {}
            for r in ended:  # newest first: a uid's runs past KEEP_ENDED_PER_UID go, however recent
                kept[r.uid] = kept.get(r.uid, 0) + 1
                if (r.ended_at or 0) < cutoff or kept[r.uid] > KEEP_ENDED_PER_UID:
                    del self._runs[r.wid]


def coop_base(settings: Settings, socket_path: Path) -> Path:
    """Where the cooperative folders of callers' workloads go (``agent_coop_dir``, else ``coop`` in the
    socket's folder); root's, 0711, so that a workload reaches its own folder by name and lists no other
    (run/cooperative.py). Never in the work dir, which stays root's alone (it holds images)."""
    base = settings.agent_coop_dir or socket_path.parent / "coop"
    try:
        os.close(secure_base(base, mode=0o711))
    except (UnsafePath, OSError) as e:
        raise ConfigError(f"the agent's folder for cooperative checkpoints {base} cannot be used: {e}. Give it to "
                          "root, writable by nobody else and in folders of root's, or set agent_coop_dir") from None
    return base


def group_ids(names: tuple[str, ...], setting: str) -> frozenset[int]:
    """A setting's groups (names, or gids in ASCII digits) as gids: one this node does not know stops the
    agent, in one line."""
    out = set()
    for name in names:
        if name.isascii() and name.isdigit():
            out.add(int(name))
            continue
        try:
            out.add(grp.getgrnam(name).gr_gid)
        except (KeyError, ValueError):
            raise ConfigError(f"{setting} names group {printable(name, 60)!r}, which this node does not have. Create "
                              "it, or name another group (or a gid)") from None
    return frozenset(out)


def _memfd(data: bytes, name: str) -> int:
    fd = os.memfd_create(f"cedana-{name}", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_fd(fd: int, limit: int) -> bytes:
    """What a caller passed in a regular file or memfd, at most ``limit`` bytes (never a pipe or a socket,
    which could keep us waiting)."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file or memfd")
        data = os.pread(fd, limit + 1, 0)
    except OSError as e:  # an O_PATH or write-only fd
        raise ValueError(f"it cannot be read ({e.strerror or e})") from None
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def _parsed(model: type[BaseModel], msg: Mapping[str, Any], op: str) -> Any:
    try:
        return model.model_validate(msg)
    except ValidationError as e:
        err = e.errors()[0]
        where = protocol.printable(".".join(str(x) for x in err["loc"]), 80) or op
        raise errors.Refused(f"{op}: {where} {err['msg'].removeprefix('Value error, ')}. Fix the request") from None

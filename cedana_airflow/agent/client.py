"""A caller's side of the node agent: connect, say hello, start a workload as ourselves, ask about it.

Imports no CRIU, store or key code: a caller never needs them (the agent holds them). A failed reply
raises the errors.py class it names, so a caller handles the agent's refusals as it handles the
in-process path's errors.
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import json
import os
import socket
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import errors
from . import protocol

__all__ = ["AgentClient", "Started"]

#: How long a connection and each answer may take before the agent counts as not answering.
CONNECT_SECONDS = 2.0
ANSWER_SECONDS = 30.0
#: The largest drill report read from the agent.
REPORT_BYTES = 16 << 20
#: How long a checkpoints query may take: the agent reads the store (manifests, for every page's IDs).
QUERY_SECONDS = 120.0


@dataclass
class Started:
    """A workload the agent started for us: ``handle`` is our proof of it; ``lifeline`` is our end
    (closing it, or our death, kills the workload; its ``exit`` event arrives on it)."""

    wid: str
    handle: str
    pid: int
    lifeline: socket.socket
    restored_seq: int | None = None  # the checkpoint it was restored from; None: started fresh
    fresh: str | None = None  # 0.8.2: why a resume started fresh (None: restored, or no resume asked)


class AgentClient:
    def __init__(self, sock: socket.socket, path: Path) -> None:
        self._sock = sock
        self.path = path
        self._ids = itertools.count(1)

    @classmethod
    def connect(cls, path: Path) -> AgentClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(CONNECT_SECONDS)
        try:
            sock.connect(str(path))
        except OSError as e:
            sock.close()
            raise errors.AgentUnavailable(f"no cedana agent answers at {path} ({e.strerror or e}). Start "
                                          "`cedana-airflow agent` on this node (docs/deploying.md)") from None
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != 0:  # whoever made that path, it is not the node's agent: nothing of ours goes to it
            sock.close()
            raise errors.AgentUnavailable(f"the socket {path} is served by uid {uid}, not root: not a node agent, and "
                                          "nothing was sent to it. Check who created it (its folder must be root's "
                                          "alone); from inside a user namespace the node's root shows as the "
                                          "overflow uid, and the agent serves no caller there")
        sock.settimeout(ANSWER_SECONDS)
        return cls(sock, path)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, op: str, fds: Sequence[int] = (), **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """One request and its reply (and the fds that came with it); a failed reply raises."""
        req_id = next(self._ids)
        closed = errors.AgentUnavailable(f"the cedana agent at {self.path} closed the connection during {op}. "
                                         "Check the agent's log")
        try:
            try:
                protocol.send(self._sock, {"op": op, "id": req_id, **fields}, fds)
            except (BrokenPipeError, ConnectionResetError):
                pass  # it refused the connection and closed it: its one line is waiting to be read below
            while True:
                reply, got = protocol.recv(self._sock)
                if reply is None:
                    raise closed
                if reply.get("id") == req_id or (reply.get("id") is None and reply.get("ok") is False):
                    break  # ours, or the connection's own refusal (too many connections, a bad sender)
                protocol.close_fds(got)  # an event, or a stale reply: not ours to keep
        except TimeoutError:
            raise errors.AgentUnavailable(f"the cedana agent at {self.path} did not answer {op} in "
                                          f"{ANSWER_SECONDS:.0f} s. Check the agent's log") from None
        except (BrokenPipeError, ConnectionResetError):
            raise closed from None
        try:
            protocol.raise_for(reply)
        except errors.CedanaError:
            protocol.close_fds(got)
            raise
        return reply, got

    def hello(self) -> dict[str, Any]:
        return self.request("hello", proto=protocol.PROTO)[0]

    def start(self, checkpoint_id: str, argv: Sequence[str], *, cwd: str | None = None,
              env: Mapping[str, str] | None = None, stdout: int, stderr: int, try_number: int = 0,
              settings: Mapping[str, Any] | None = None, claim: Mapping[str, Any] | None = None,
              resume: bool = False, restore_only: bool = False) -> Started:
        """Start ``argv`` as us, checkpointed under ``checkpoint_id``; ``stdout``/``stderr``: write ends the
        workload gets (ours stay ours to close), of pipes we made (0.8.4: the agent refuses anything else);
        ``settings``: task settings (agent/workloads.py: TASK_SETTINGS); ``claim``: the Airflow task this is
        (dag_id, task_id, run_id, map_index); ``resume``: restore the newest checkpoint of
        ``checkpoint_id`` when there is one (a retry); ``restore_only`` (``argv`` empty): only that, none
        being an error (hello's feature ``restore``)."""
        fields: dict[str, Any] = {"checkpoint_id": checkpoint_id, "argv": list(argv), "cwd": cwd or os.getcwd(),
                                  "env": dict(os.environ if env is None else env), "try_number": try_number,
                                  "settings": dict(settings or {}), "resume": resume}
        if claim is not None:
            fields["claim"] = dict(claim)
        if restore_only:
            fields["restore_only"] = True
        with self._answer_within(None):  # the node's writer lease may make a start wait
            reply, fds = self.request("start", [stdout, stderr], **fields)
        if len(fds) != 1:
            protocol.close_fds(fds)
            raise errors.AgentUnavailable(f"the cedana agent at {self.path} started {reply.get('wid')} but sent no "
                                          "lifeline. Upgrade the agent")
        seq, fresh = reply.get("restored_seq"), reply.get("fresh")
        return Started(str(reply["wid"]), str(reply["handle"]), int(reply["pid"]), socket.socket(fileno=fds[0]),
                       int(seq) if isinstance(seq, int) else None, str(fresh)[:2000] if fresh else None)

    def status(self, wid: str, handle: str, said_since: int = 0) -> dict[str, Any]:
        """The run's state; its ``said`` (0.8.3 agents): ``[n, line]`` of the lines about it after ``said_since``."""
        return self.request("status", wid=wid, handle=handle, said_since=said_since)[0]

    def stop(self, wid: str, handle: str) -> dict[str, Any]:
        """The final checkpoint, then the end (as SIGTERM to a supervisor); its status once ended."""
        with self._answer_within(None):
            return self.request("stop", wid=wid, handle=handle)[0]

    def kill(self, wid: str, handle: str) -> dict[str, Any]:
        """The end, without a checkpoint; its status once ended."""
        return self.request("kill", wid=wid, handle=handle)[0]

    @contextlib.contextmanager
    def _answer_within(self, seconds: float | None) -> Iterator[None]:
        """An op whose answer may take longer than :data:`ANSWER_SECONDS` (a lease, a final checkpoint); a
        dead agent still ends it (the connection closes)."""
        before = self._sock.gettimeout()
        self._sock.settimeout(seconds)
        try:
            yield
        finally:
            self._sock.settimeout(before)

    def list(self) -> list[dict[str, Any]]:
        return list(self.request("list")[0]["workloads"])

    def drill(self, mode: str, params: Mapping[str, Any] | None = None, *,
              report: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Have the agent run a ``verify`` or ``canary`` drill with ``params`` (the reply's ``report``), or
        ``keep`` a live drill's ``report`` in the store (``kept``). For root and agent_drillers only. Reports
        travel in a memfd (a busy fleet's is larger than a message)."""
        hello = self.hello()
        if "drill" not in hello.get("features", ()):
            raise errors.AgentUnavailable(f"the cedana agent at {self.path} runs {hello.get('agent', 'an older version')}"
                                          ", which runs no drills for a caller (0.8.4 and later do). Upgrade it")
        fields: dict[str, Any] = {"mode": mode, "params": dict(params or {})}
        fds: list[int] = []
        if report is not None:
            fds = [os.memfd_create("cedana-report", os.MFD_CLOEXEC)]
            os.write(fds[0], json.dumps(report).encode())
        try:
            with self._answer_within(None):  # a canary takes its steps' time; a dead agent still ends it
                reply, got = self.request("drill", fds, **fields)
        finally:
            protocol.close_fds(fds)
        if mode == "keep":
            protocol.close_fds(got)
            return reply
        try:
            if len(got) != 1 or not isinstance(reply.get("report_bytes"), int):
                raise errors.AgentUnavailable(f"the cedana agent at {self.path} sent no report for its {mode} drill. "
                                              "Check the agent's log")
            data = os.pread(got[0], min(int(reply.get("report_bytes", 0)), REPORT_BYTES), 0)
        finally:
            protocol.close_fds(got)
        return {**reply, "report": json.loads(data)}

    def checkpoints(self, ids: Sequence[str] | None = None, *, detail: bool = False) -> builtins.list[dict[str, Any]]:
        """What we may know of the store's checkpoints (agent/views.py): a row per ID of ``ids`` we may see
        (None: every ID, page by page, for a caller that sees every ID); ``detail``: each named ID's writer
        lease, restore records and newest checkpoints.
        An agent older than 0.8.4 cannot answer: :class:`errors.AgentUnavailable`, naming it."""
        hello = self.hello()
        if "checkpoints" not in hello.get("features", ()):
            raise errors.AgentUnavailable(f"the cedana agent at {self.path} runs {hello.get('agent', 'an older version')}"
                                          ", which cannot answer checkpoint queries (0.8.4 and later can). Upgrade it")
        rows: builtins.list[dict[str, Any]] = []
        with self._answer_within(QUERY_SECONDS):  # the agent reads the store, which may be slow
            if ids is not None:
                step = 1 if detail else protocol.MAX_QUERY_IDS  # a detailed row is asked for alone
                for at in range(0, len(ids), step):
                    ask = list(ids[at:at + step])
                    while ask:  # what did not fit one reply is asked for again
                        reply = self.request("checkpoints", ids=ask, detail=detail)[0]
                        rows += reply["rows"]
                        rest = list(reply.get("rest") or ())
                        if len(rest) >= len(ask):
                            raise errors.AgentUnavailable(f"the cedana agent at {self.path} answered none of "
                                                          f"{len(ask)} IDs. Check the agent's log")
                        ask = rest
                return rows
            after = ""
            while True:
                reply = self.request("checkpoints", after=after)[0]
                rows += reply["rows"]
                if not reply.get("next"):
                    return rows
                after = str(reply["next"])

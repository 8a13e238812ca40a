"""A caller's side of the node agent: connect, say hello, start a workload as ourselves, ask about it.

Imports no CRIU, store or key code: a caller never needs them (the agent holds them). A failed reply
raises the errors.py class it names, so a caller handles the agent's refusals as it handles the
in-process path's errors.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import errors
from . import protocol

__all__ = ["AgentClient", "Started"]

#: How long a connection and each answer may take before the agent counts as not answering.
CONNECT_SECONDS = 2.0
ANSWER_SECONDS = 30.0


@dataclass
class Started:
    """A workload the agent started for us: ``handle`` is our proof of it; ``lifeline`` is our end
    (closing it, or our death, kills the workload; its ``exit`` event arrives on it)."""

    wid: str
    handle: str
    pid: int
    lifeline: socket.socket


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
        try:
            protocol.send(self._sock, {"op": op, "id": req_id, **fields}, fds)
            while True:
                reply, got = protocol.recv(self._sock)
                if reply is None:
                    raise errors.AgentUnavailable(f"the cedana agent at {self.path} closed the connection during "
                                                  f"{op}. Check the agent's log")
                if reply.get("id") == req_id:
                    break
                protocol.close_fds(got)  # an event, or a stale reply: not ours to keep
        except TimeoutError:
            raise errors.AgentUnavailable(f"the cedana agent at {self.path} did not answer {op} in "
                                          f"{ANSWER_SECONDS:.0f} s. Check the agent's log") from None
        try:
            protocol.raise_for(reply)
        except errors.CedanaError:
            protocol.close_fds(got)
            raise
        return reply, got

    def hello(self) -> dict[str, Any]:
        return self.request("hello", proto=protocol.PROTO)[0]

    def start(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
              stdout: int, stderr: int, deny_io_uring: bool = True) -> Started:
        """Start ``argv`` as us; ``stdout``/``stderr``: write ends the workload gets (ours stay ours to close)."""
        reply, fds = self.request("start", [stdout, stderr], argv=list(argv), cwd=cwd or os.getcwd(),
                                  env=dict(os.environ if env is None else env), deny_io_uring=deny_io_uring)
        if len(fds) != 1:
            protocol.close_fds(fds)
            raise errors.AgentUnavailable(f"the cedana agent at {self.path} started {reply.get('wid')} but sent no "
                                          "lifeline. Upgrade the agent")
        return Started(str(reply["wid"]), str(reply["handle"]), int(reply["pid"]), socket.socket(fileno=fds[0]))

    def status(self, wid: str, handle: str) -> dict[str, Any]:
        return self.request("status", wid=wid, handle=handle)[0]

    def kill(self, wid: str, handle: str) -> dict[str, Any]:
        return self.request("kill", wid=wid, handle=handle)[0]

    def list(self) -> list[dict[str, Any]]:
        return list(self.request("list")[0]["workloads"])

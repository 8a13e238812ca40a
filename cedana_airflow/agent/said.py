"""What the agent says about a run, kept for its caller (issue 49).

Run in a task process, the supervisor's lines (the heartbeat it chose and why, a heartbeat skipped or
failed, a checkpoint saved) land in the task's log. Through the agent they are the agent's log lines:
:class:`Said` keeps those that name the run's checkpoint ID, numbered, for the run's ``status`` to hand
its owner, who logs them (agent/route.py). Bounded: a caller that does not ask loses the oldest.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading

from . import protocol

__all__ = ["KEPT", "NAMED", "Said"]

#: Lines kept per run: a minute of one-second heartbeats with room to spare; and at most this much of
#: them, as JSON (the agent keeps a uid's ended runs a while: server.py caps how many).
KEPT = 200
KEPT_BYTES = 256 << 10
#: The most of them one reply carries, as JSON (a reply is at most protocol.MAX_MESSAGE): the rest come
#: with the next.
REPLY_BYTES = 16 << 10
#: A checkpoint ID a line names: every character ids.py allows, as many as follow.
NAMED = re.compile(r"checkpoint_id=([A-Za-z0-9._=+@-]*)")
_AGENT_LOGGERS = ("cedana_airflow.agent.",)


class Said(logging.Handler):
    """While attached (``with Said(cid):``) to our package's logger, keeps each record at INFO or above
    whose message names ``checkpoint_id=<cid>``, or that carries it (``extra={"checkpoint_id": cid}``: a
    heartbeat's line), and no other ID (the agent's own loggers aside), as
    ``(n, line)`` with n counting from 1."""

    def __init__(self, checkpoint_id: str) -> None:
        super().__init__(logging.INFO)
        self.checkpoint_id = checkpoint_id
        self._lines: collections.deque[tuple[int, str]] = collections.deque()
        self._n = 0
        self._bytes = 0  # the kept lines' size, as JSON
        self._mutex = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(_AGENT_LOGGERS):  # the agent's own lines quote what callers sent
            return
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a bad format is the logger's problem, never the run's)
            return
        # Every ID the line names must be this run's: a line may quote a caller's text (a file name in a
        # CRIU error, its failure history), which must not carry it into another run's lines.
        named = NAMED.findall(message)
        if (carried := getattr(record, "checkpoint_id", None)) is not None:  # a line that says its ID once, at start
            named.append(carried)
        if not named or any(cid != self.checkpoint_id for cid in named):
            return
        line = protocol.printable(message, 2000)
        with self._mutex:
            self._n += 1
            self._lines.append((self._n, line))
            self._bytes += _size(line)
            while len(self._lines) > KEPT or (self._bytes > KEPT_BYTES and len(self._lines) > 1):  # the oldest go
                self._bytes -= _size(self._lines.popleft()[1])

    def since(self, n: int) -> tuple[list[list[int | str]], bool]:
        """The lines kept after line ``n`` (JSON-ready: ``[number, line]``), as many as fit
        :data:`REPLY_BYTES`; and whether more are kept after them."""
        out: list[list[int | str]] = []
        size = 0
        with self._mutex:
            for i, line in self._lines:
                if i <= n:
                    continue
                size += _size(line)
                if out and size > REPLY_BYTES:
                    return out, True
                out.append([i, line])
        return out, False

    def __enter__(self) -> Said:
        logging.getLogger("cedana_airflow").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("cedana_airflow").removeHandler(self)


def _size(line: str) -> int:
    """A line's size as a reply carries it: JSON, where a character outside ASCII is a \\uXXXX escape."""
    return len(json.dumps(line)) + 16

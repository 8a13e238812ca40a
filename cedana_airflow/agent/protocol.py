"""The node agent's wire protocol: one JSON object per ``SOCK_SEQPACKET`` message, fds by SCM_RIGHTS.

SEQPACKET keeps message boundaries, so an fd travels with the message it belongs to (over a byte
stream it would attach to a byte). A request is ``{"op": ..., "id": n, ...}``; its reply
``{"id": n, "ok": true, ...}`` or ``{"id": n, "ok": false, "error": CLASS, "line": ...}``, where CLASS
names an errors.py class, so a client raises what the in-process path raises; an event is
``{"ev": ...}``. :data:`PROTO` rises only when an op changes meaning: within one, fields and ops are
only added, a reader ignores fields it does not know, and an unknown op is refused by name.

Who the caller is comes from the kernel (``SO_PEERCRED``, ``SO_PEERGROUPS``), never from a message.
No Airflow import; the shim (shim.py, standard library only) speaks the same framing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..config import printable  # the agent's audit and log lines (and a caller's)

__all__ = ["MAX_FDS", "MAX_MESSAGE", "MAX_QUERY_IDS", "PROTO", "TASK_SETTINGS", "Peer", "Sender", "close_fds", "error_reply", "pass_credentials",
           "printable", "raise_for", "recv", "recv_from", "recv_packet", "send"]

#: The protocol's version (see the module doc for what may change within one).
PROTO = 1

#: The settings a caller's ``start`` may carry: how often and when its own workload is checkpointed and
#: kept. Anything else (where checkpoints go, which key signs them, which CRIU runs, commands run as
#: root: lease_renew_command, cooperative_verify_command) is the node's.
TASK_SETTINGS = frozenset({
    "heartbeat_seconds", "heartbeat_min_seconds", "heartbeat_max_seconds", "mtbf_hours", "checkpoint_on_term",
    "stop_grace_seconds", "stop_window_seconds", "keep_checkpoints", "delete_on_success", "max_restore_gap_seconds",
    "progress",
    "lease_seconds",  # 0.8.2: a license's lease only decides fresh or restore; renewing it is the node's command
    # 0.8.3: what Airflow's history says of the caller's own queue, for heartbeat = auto: its word moves only its
    # own interval, within its own heartbeat_min/max
    "failure_history",
    # 0.8.4: cooperative checkpoints through the agent (run/cooperative.py: its folders are the caller's); the
    # command that verifies a state stays the node's
    "mode", "cooperative_timeout_seconds", "cooperative_signal",
})
#: The largest message either side sends or accepts: argv and env are the only big fields.
MAX_MESSAGE = 64 << 10
#: The most checkpoint IDs one ``checkpoints`` query names (0.8.4; agent/views.py).
MAX_QUERY_IDS = 32
#: The most fds one message carries (a start's stdout and stderr; a reply's lifeline).
MAX_FDS = 4

_SO_PEERGROUPS = 59  # asm-generic/socket.h (every architecture we build for); no socket constant in 3.11
_MAX_GROUPS = 256  # CPython's getsockopt reads at most 1024 bytes


def send(sock: socket.socket, msg: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """One message (and ``fds``, duplicated into the peer) as one packet."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise errors.Refused(f"agent message too large: {len(data)} bytes, at most {MAX_MESSAGE}. "
                             "Pass a smaller environment or argument list")
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} fds in one message, at most {MAX_FDS}")
    socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the fds that came with it (close-on-exec, the receiver's to close); ``(None,
    [])`` at end of stream. A message that is too large, carries too many fds or is not a JSON object is
    :class:`errors.Refused`, its fds closed."""
    msg, fds, _ = recv_from(sock)
    return msg, fds


def recv_from(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int], Sender | None]:
    """:func:`recv`, and who sent this message, as the kernel says (on a socket with ``SO_PASSCRED``:
    see :func:`pass_credentials`; else None)."""
    data, fds, flags, sender = recv_packet(sock, MAX_MESSAGE + 1, MAX_FDS)
    if not data and not fds:
        return None, [], sender
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE:
            raise errors.Refused(f"agent message refused: larger than {MAX_MESSAGE} bytes or more than {MAX_FDS} "
                                 "fds. Send less")
        try:
            msg = json.loads(data)
        except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested past the parser's depth
            raise errors.Refused(f"agent message refused: not JSON ({str(e)[:80]}). Send one JSON object per "
                                 "message") from None
        if not isinstance(msg, dict):
            raise errors.Refused(f"agent message refused: a JSON {type(msg).__name__}, not an object. "
                                 "Send one JSON object per message")
    except errors.Refused:
        close_fds(fds)
        raise
    return msg, fds, sender


@dataclass(frozen=True)
class Sender:
    """Who sent one message (``SCM_CREDENTIALS``): the kernel's word, which a sender cannot forge."""

    pid: int
    uid: int
    gid: int


def pass_credentials(sock: socket.socket) -> None:
    """Have the kernel attach its sender's credentials to every message this socket receives. A
    connection's ``SO_PEERCRED`` is its *connector's*, fixed at connect(2) (unix(7)); a root process that
    connects and then drops to another uid, or hands the socket on, would otherwise act as root."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)


def recv_packet(sock: socket.socket, size: int, max_fds: int) -> tuple[bytes, list[int], int, Sender | None]:
    """One packet, its fds (close-on-exec), the message flags and its sender (where the socket passes
    credentials). ``socket.recv_fds`` drops its flags argument (CPython 3.11), so its fds would be
    inherited by every program this process starts."""
    data, ancdata, flags, _ = sock.recvmsg(size, socket.CMSG_SPACE(max_fds * 4) + socket.CMSG_SPACE(12),
                                           socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    sender = None
    for level, kind, raw in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += struct.unpack(f"{len(raw) // 4}i", raw[: len(raw) - len(raw) % 4])
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(raw) >= 12:
            sender = Sender(*struct.unpack("3i", raw[:12]))
    return data, fds, flags, sender


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a unix socket, as the kernel saw it when it connected."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]

    @classmethod
    def of(cls, sock: socket.socket) -> Peer:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
        except OSError as e:
            if e.errno != errno.ERANGE:
                raise
            raise errors.Refused(f"uid {uid} (pid {pid}) is in more than {_MAX_GROUPS} groups, which the agent "
                                 "does not read yet. Run the task as a user in fewer groups") from None
        return cls(pid, uid, gid, tuple(sorted(struct.unpack(f"{len(raw) // 4}I", raw))))

    def __str__(self) -> str:
        return f"uid {self.uid} (pid {self.pid})"


def error_reply(req_id: Any, e: errors.CedanaError) -> dict[str, Any]:
    """The reply that makes the client raise ``e``'s class with ``e``'s line."""
    return {"id": req_id, "ok": False, "error": type(e).__name__, "line": str(e)}


def raise_for(reply: Mapping[str, Any]) -> None:
    """Raise the error a failed reply names (an errors.py class; one this client does not know is a
    :class:`errors.CedanaError`, so a newer agent's new error still reads as one line)."""
    if reply.get("ok") is True:
        return
    line = str(reply.get("line") or "the agent refused without saying why")
    cls = getattr(errors, str(reply.get("error")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CedanaError)):
        cls = errors.CedanaError
    err: errors.CedanaError
    try:
        err = cls(line)
    except TypeError:  # a class with more required arguments: its line is what a person reads
        err = errors.CedanaError(line)
    raise err


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)

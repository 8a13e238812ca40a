"""The agent's wire protocol (agent/protocol.py): framing, fds, limits, who the peer is, and errors that
reach a client as the class the in-process path raises."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from cedana_airflow import errors
from cedana_airflow.agent import protocol


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


def test_a_message_and_its_fds_arrive_together_and_close_on_exec(pair):
    a, b = pair
    r, w = os.pipe()
    protocol.send(a, {"op": "start", "id": 1, "argv": ["python", "é"]}, [r, w])
    os.close(r)
    os.close(w)
    msg, fds = protocol.recv(b)
    assert msg == {"op": "start", "id": 1, "argv": ["python", "é"]} and len(fds) == 2
    assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in fds)
    os.write(fds[1], b"through")
    assert os.read(fds[0], 16) == b"through"
    protocol.close_fds(fds)
    a.close()
    assert protocol.recv(b) == (None, [])  # the end of the stream


def test_a_message_too_large_is_refused_on_either_side_in_one_line_and_its_fds_are_closed(pair):
    a, b = pair
    with pytest.raises(errors.Refused, match=r"^agent message too large: \d+ bytes, at most 65536\. Pass a smaller"):
        protocol.send(a, {"env": {"X": "x" * protocol.MAX_MESSAGE}})
    r, w = os.pipe()
    os.close(w)
    socket.send_fds(a, [b"{" + b" " * protocol.MAX_MESSAGE + b"}"], [r])  # a raw packet past the limit
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(errors.Refused, match="larger than 65536 bytes"):
        protocol.recv(b)
    assert set(os.listdir("/proc/self/fd")) <= before  # the fd that came with it was not kept
    os.close(r)


@pytest.mark.parametrize("raw,what", [(b"not json", "not JSON"), (b"[1, 2]", "a JSON list, not an object")])
def test_a_message_that_is_not_a_json_object_is_refused(pair, raw, what):
    a, b = pair
    a.send(raw)
    with pytest.raises(errors.Refused, match=what):
        protocol.recv(b)


def test_the_peer_is_who_the_kernel_says_not_who_the_message_says(pair):
    a, b = pair
    me = protocol.Peer.of(b)
    assert (me.pid, me.uid, me.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert set(me.groups) == set(os.getgroups())
    if os.geteuid() != 0:
        return
    # a process of another uid connecting to a listening socket (credentials are taken at connect)
    path = f"/tmp/cedana-protocol-{os.getpid()}.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    os.chmod(path, 0o666)
    srv.listen()
    try:
        child = os.fork()
        if child == 0:
            try:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                c.connect(path)
                protocol.send(c, {"op": "hello", "uid": 0})  # it says it is root
                c.recv(1)
            finally:
                os._exit(0)
        conn, _ = srv.accept()
        msg, _ = protocol.recv(conn)
        peer = protocol.Peer.of(conn)
        conn.close()
        os.waitpid(child, 0)
    finally:
        srv.close()
        os.unlink(path)
    assert msg == {"op": "hello", "uid": 0}
    assert (peer.pid, peer.uid, peer.gid, peer.groups) == (child, 65534, 65534, ())
    assert str(peer) == f"uid 65534 (pid {child})"


def test_a_failed_reply_raises_the_class_it_names_with_its_line():
    reply = protocol.error_reply(7, errors.CheckpointNotFound("no checkpoint under job: start fresh"))
    assert reply == {"id": 7, "ok": False, "error": "CheckpointNotFound", "line": "no checkpoint under job: start fresh"}
    with pytest.raises(errors.CheckpointNotFound, match="^no checkpoint under job: start fresh$"):
        protocol.raise_for(reply)
    with pytest.raises(errors.CedanaError, match="^from a newer agent$") as e:
        protocol.raise_for({"ok": False, "error": "SomethingNew", "line": "from a newer agent"})
    assert type(e.value) is errors.CedanaError
    with pytest.raises(errors.CedanaError, match="^from a newer agent$") as e:
        protocol.raise_for({"ok": False, "error": "ValueError", "line": "from a newer agent"})  # never a non-ours class
    assert type(e.value) is errors.CedanaError
    protocol.raise_for({"id": 7, "ok": True})

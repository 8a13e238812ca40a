"""The page-server side of CRIU's lazy-pages protocol, driven by a client that speaks it as CRIU does."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from cedana_airflow.engine.page_server import PS_IOV_CLOSE, PS_IOV_GET, PageServer, wire_for

PAGE = 4096


def _source(pid: int, vaddr: int, nr: int) -> list[bytes]:
    if vaddr == 0xDEAD000:
        raise OSError("the store went away")
    n = min(nr, 3)  # runs of three pages: longer requests get fewer, as CRIU's own server may answer
    return [bytes([pid % 256, (vaddr >> 12) % 256 + i]) * (PAGE // 2) for i in range(n)]


@pytest.mark.parametrize("version,size", [("4.1.1", 24), ("4.2", 32), ("5.0", 32)])
def test_each_request_is_answered_in_order_with_the_layout_of_its_criu_version(version, size):
    wire = wire_for(version)
    assert wire.size == size
    ours, theirs = socket.socketpair()
    server = PageServer(ours, _source, lambda e: None, wire=wire)
    server.start()
    theirs.sendall(wire.pack(PS_IOV_GET, 2, 0x10000, 5) + wire.pack(PS_IOV_GET, 8, 0x20000, 6))
    for vaddr, pid, n in ((0x10000, 5, 2), (0x20000, 6, 3)):
        head = theirs.recv(size, socket.MSG_WAITALL)
        cmd, got_n, got_vaddr, dst = wire.unpack(head)
        assert (cmd & 0xFFFF, cmd >> 16, got_n, got_vaddr, dst) == (6, 4, n, vaddr, pid)  # PS_IOV_ADD_F, PE_PRESENT
        body = theirs.recv(n * PAGE, socket.MSG_WAITALL)
        assert body == b"".join(_source(pid, vaddr, n))
    theirs.sendall(wire.pack(PS_IOV_CLOSE, 0, 0, 0))
    assert struct.unpack("=i", theirs.recv(4, socket.MSG_WAITALL)) == (0,)
    server.join(5)
    assert server.closed_cleanly and server.requests == 2 and server.served_bytes == 5 * PAGE


def test_a_failing_source_answers_nothing_and_keeps_the_socket_open_until_released():
    wire = wire_for("4.1.1")
    ours, theirs = socket.socketpair()
    failed = threading.Event()
    server = PageServer(ours, _source, lambda e: failed.set(), wire=wire)
    server.start()
    theirs.sendall(wire.pack(PS_IOV_GET, 1, 0xDEAD000, 1))
    assert failed.wait(5)
    theirs.settimeout(0.3)
    with pytest.raises(socket.timeout):  # no answer, and no end of file: a faulting process stays blocked
        theirs.recv(1)
    server.release()
    server.join(5)
    theirs.settimeout(5)
    assert theirs.recv(1) == b"" and isinstance(server.error, OSError)

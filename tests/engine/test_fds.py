"""Files CRIU cannot carry are named before the tree is frozen (issue 47): an io_uring (what a torchrun
job's TCPStore held), and with a CRIU before 4.2 on Linux 6.16+, any TCP or UDP socket."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cedana_airflow.engine import fds

#: A child holding an io_uring (io_uring_setup, syscall 425 on every architecture), an epoll and an
#: eventfd (which CRIU carries), a listening TCP socket and a UDP one; it says its port and waits.
_CHILD = textwrap.dedent("""
    import ctypes, os, select, socket, sys
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    ring = libc.syscall(425, 4, params)
    assert ring >= 0, os.strerror(ctypes.get_errno())
    ep = select.epoll()
    ev = os.eventfd(0)
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0))
    print(ring, s.fileno(), s.getsockname()[1], u.fileno(), u.getsockname()[1], flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ring, tcp_fd, tcp_port, udp_fd, udp_port = (int(x) for x in p.stdout.readline().split())
        yield p.pid, ring, tcp_fd, tcp_port, udp_fd, udp_port
    finally:
        p.kill()
        p.wait()


def test_an_io_uring_is_named_with_its_process_and_remedy_and_epoll_and_eventfd_are_not(child):
    pid, ring, *_ = child
    [u] = fds.uncarried([pid], "4.2.1")
    assert (u.pid, u.fd, u.what) == (pid, ring, "anon_inode:[io_uring]")
    assert u.line().startswith(f"pid {pid} ({sys.executable} -c ") and "set io_uring = deny" in u.line()


def test_sockets_are_named_only_where_this_criu_cannot_dump_them(child):
    pid, ring, tcp_fd, tcp_port, udp_fd, udp_port = child
    old = [u for u in fds.uncarried([pid], "4.1.1", kernel="6.18.44") if u.fd != ring]
    assert [(u.fd, u.what) for u in old] == sorted([(tcp_fd, f"a socket (TCP 127.0.0.1:{tcp_port} LISTEN)"),
                                                    (udp_fd, f"a socket (UDP 127.0.0.1:{udp_port})")])
    assert "install CRIU 4.2 or later (scripts/install-criu.sh)" in old[0].line()
    assert [u.fd for u in fds.uncarried([pid], "4.1.1", kernel="6.12.0")] == [ring]  # the kernel still allows it
    assert [u.fd for u in fds.uncarried([pid], "4.2.1", kernel="6.18.44")] == [ring]


def test_ipv6_endpoints_read_as_people_write_them():
    assert fds._endpoint("00000000000000000000000001000000:1F90") == "[::1]:8080"
    assert fds._endpoint("0100007F:0050") == "127.0.0.1:80"


@pytest.mark.skipif(os.geteuid() != 0, reason="dump() needs root")
def test_a_dump_of_a_tree_with_an_io_uring_is_refused_before_the_tree_is_frozen(child, tmp_path):
    from cedana_airflow.engine.criu import CriuEngine, find_criu
    from cedana_airflow.errors import DumpFailed
    from pathlib import Path

    pid, ring, *_ = child
    engine = CriuEngine(find_criu("", Path("/opt/cedana-airflow/criu")))
    with pytest.raises(DumpFailed) as e:
        engine.dump(pid, tmp_path / "images")
    assert str(e.value).startswith(f"criu dump of pid {pid} not started: pid {pid} (")
    assert f"holds anon_inode:[io_uring] on fd {ring}: CRIU cannot checkpoint an io_uring" in str(e.value)
    assert not (tmp_path / "images").exists() and not (tmp_path / "images.dump.log").exists()  # CRIU never ran

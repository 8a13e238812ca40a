"""A checkpoint's sockets on the node that restores it (issue 47), against a real CRIU dump: a tree with
a listener, a connection inside it, a connection to a peer outside, and a connected UDP socket. What
stands in the way on the node is named (NodeInTheWay), never taken for a bad checkpoint."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX
from cedana_airflow.engine import inet_image
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.errors import NodeInTheWay
from cedana_airflow.run.sockets import prepare_sockets
from cedana_airflow.run.workload import Workload

pytestmark = pytest.mark.integration

_TREE = """
import os, socket, sys, time
port, peer, udp_peer = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
srv = socket.create_server(("127.0.0.1", port))
inner = socket.create_connection(("127.0.0.1", port)); accepted, _ = srv.accept()
outer = socket.create_connection(("127.0.0.1", peer))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.connect(("127.0.0.1", udp_peer))
print("ready", flush=True)
while True: time.sleep(0.05)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumped(tmp_path: Path, code: str, *args: object) -> Path:
    """The images of a tree running ``code`` with ``args`` (it prints ``ready``), dumped by CRIU and gone."""
    out = open(tmp_path / "tree.out", "w+b")
    w = Workload.start([sys.executable, "-c", code, *map(str, args)], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 20
        while b"ready" not in (tmp_path / "tree.out").read_bytes():
            assert w.poll() is None and time.monotonic() < deadline, (tmp_path / "tree.out").read_bytes()
            time.sleep(0.05)
        return CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX))).dump(w.pid, tmp_path / "images").image_dir
    finally:
        w.stop(1, 9)


@pytest.fixture
def images(tmp_path):
    """The images of the tree above, dumped by CRIU and the tree gone; its listener's port; the peer."""
    peer = socket.create_server(("127.0.0.1", 0))
    udp_peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp_peer.bind(("127.0.0.1", 0))
    port = _free_port()
    image_dir = _dumped(tmp_path, _TREE, port, peer.getsockname()[1], udp_peer.getsockname()[1])
    yield image_dir, port, peer.getsockname()[1]
    peer.close()
    udp_peer.close()


def test_the_image_tells_inside_from_outside_and_a_rewrite_closes_only_the_outside_one(images):
    image_dir, port, peer = images
    socks = inet_image.read_inet_sockets(image_dir)
    inside, outside = inet_image.in_tree(socks)
    assert sorted(s.describe().split(" to ")[0].split()[-1] for s in inside) == ["ESTABLISHED", "ESTABLISHED"]
    assert [s.describe().rsplit(" ", 1)[-1] for s in outside] == [f"127.0.0.1:{peer}"]
    assert [s.describe() for s in socks if s.state == 10] == [f"TCP 127.0.0.1:{port} LISTEN"]
    before = (image_dir / "files.img").read_bytes()
    assert prepare_sockets(image_dir, "checkpoint t seq=1") == outside
    after = {s.index: s for s in inet_image.read_inet_sockets(image_dir)}
    [closed] = [after[s.index] for s in outside]
    assert (closed.state, closed.src[1], closed.dst[1]) == (7, 0, 0)  # CLOSE, unbound, unconnected
    assert all(after[s.index] == s for s in inside)  # carried whole
    assert len((image_dir / "files.img").read_bytes()) > len(before) - 16  # nothing else lost


def test_a_port_a_live_process_holds_is_waited_for_then_named(images):
    image_dir, port, _ = images
    holder = subprocess.Popen([sys.executable, "-c", f"import socket, time\ns = socket.create_server(('127.0.0.1', {port}))"
                               "\nprint('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        t0 = time.monotonic()
        with pytest.raises(NodeInTheWay) as e:
            prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.6)
        assert time.monotonic() - t0 >= 0.6
    finally:
        holder.kill()
        holder.wait()
    assert str(e.value).startswith(f"checkpoint t seq=1 cannot be restored on this node: the port of its socket TCP "
                                   f"127.0.0.1:{port} LISTEN is held here by pid {holder.pid} ({sys.executable} -c ")
    assert str(e.value).endswith("). Stop that process, or let the retry run on another node; the checkpoint stays "
                                 "the latest")
    prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.6)  # the holder gone, the port binds


def test_a_port_freed_while_waiting_is_taken(images):
    image_dir, port, _ = images
    holder = socket.create_server(("127.0.0.1", port))
    slept: list[float] = []

    def sleep(s: float) -> None:  # the dying previous tree lets go of it
        slept.append(s)
        holder.close()

    prepare_sockets(image_dir, "checkpoint t seq=1", sleep=sleep)
    assert slept == [0.2]


def test_a_listener_on_an_address_this_node_lacks_moves_to_this_nodes_address_for_it(images, caplog):
    """Bound to the checkpoint node's own address (as torchrun's store is, to the pod's IP): it moves to the
    address this node would send from to reach that one, and keeps its port."""
    import logging
    import subprocess

    image_dir, port, _ = images
    [listener] = [s for s in inet_image.read_inet_sockets(image_dir) if s.state == 10]
    foreign = int.from_bytes(socket.inet_aton("192.0.2.7"), "little")  # TEST-NET-1: no node has it
    inet_image._rewrite(image_dir, {listener.index: {11: foreign}})
    route = subprocess.run(["ip", "-j", "route", "get", "192.0.2.7"], capture_output=True, text=True)
    if route.returncode != 0:
        pytest.skip("no route to 192.0.2.7 here")
    here = json.loads(route.stdout)[0]["prefsrc"]
    with caplog.at_level(logging.INFO, logger="cedana_airflow"):
        prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.1)
    [moved] = [s for s in inet_image.read_inet_sockets(image_dir) if s.state == 10]
    assert moved.src == (here, port)
    assert f"restore moves the tree's address 192.0.2.7 to {here} on this node (1 socket(s)" in caplog.text


def test_a_foreign_listener_that_shares_ports_is_in_the_way_too(images):
    """A live server with SO_REUSEPORT (nginx reuseport, uvicorn --reuse-port) on the port: CRIU, which sets
    SO_REUSEPORT on every socket it restores, would bind beside it and take its connections."""
    image_dir, port, _ = images
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (the tree's own connections left TIME_WAIT)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        with pytest.raises(NodeInTheWay, match=rf"TCP 127\.0\.0\.1:{port} LISTEN is held here by pid "):
            prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.3)
    finally:
        holder.close()


def test_a_connection_the_listener_has_not_accepted_yet_does_not_fail_the_dump(tmp_path):
    """A serving worker under load always has one: CRIU refuses the dump without --skip-in-flight."""
    out = open(tmp_path / "tree.out", "w+b")
    port = _free_port()
    w = Workload.start([sys.executable, "-c", f"import socket, time\ns = socket.create_server(('127.0.0.1', {port}))\n"
                        "print('listening', flush=True)\ntime.sleep(60)"], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 20
        while b"listening" not in (tmp_path / "tree.out").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port)):  # in its accept queue, never accepted
            r = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX))).dump(w.pid, tmp_path / "images")
        assert r.freeze_seconds > 0 and w.poll() is None
    finally:
        w.stop(1, 9)


def test_an_ipv6_socket_on_a_node_booted_without_ipv6_is_named_mocked_no_such_node_here(tmp_path, monkeypatch):
    """A node booted with ``ipv6.disable=1`` refuses every AF_INET6 socket (EAFNOSUPPORT); none exists here,
    so the socket module is made to answer as one does. The restore says so in one line, NodeInTheWay:
    the node, not the checkpoint."""
    port = _free_port()
    image_dir = _dumped(tmp_path, f"import socket, time\ns = socket.create_server(('::1', {port}), "
                                  "family=socket.AF_INET6)\nprint('ready', flush=True)\ntime.sleep(60)")
    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *a, **k):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *a, **k)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    with pytest.raises(NodeInTheWay) as e:
        prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.1)
    assert str(e.value) == (f"checkpoint t seq=1 cannot be restored on this node: its socket TCP [::1]:{port} LISTEN "
                            "is IPv6, and this node runs without IPv6 (booted with ipv6.disable=1). Let the retry run "
                            "on a node with IPv6; the checkpoint stays the latest")


def test_a_udp_service_that_shares_ports_holds_a_udp_servers_port_too(tmp_path):
    """A live UDP service with SO_REUSEADDR (DNS, syslog and statsd daemons set it) on the port of the
    tree's UDP server: two UDP sockets that both set it share the port, and CRIU sets it on what it
    restores, so the restored tree would take the service's datagrams. Review 2 saw it answer all 8."""
    port = _free_port()
    image_dir = _dumped(tmp_path, f"import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                  f"s.bind(('127.0.0.1', {port}))\nprint('ready', flush=True)\ntime.sleep(60)")
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    try:
        with pytest.raises(NodeInTheWay, match=rf"UDP 127\.0\.0\.1:{port} is held here by pid {os.getpid()} "):
            prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.3)
    finally:
        holder.close()
    prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.3)  # the service gone, the port binds


def test_a_udp_client_of_a_service_outside_restores_unbound_on_a_node_without_ip(tmp_path, monkeypatch):
    """A connected UDP socket to a service outside, bound (by its connect) to the checkpoint node's address:
    nothing of the tree is at that address, so nothing moves; it is restored unbound, and connect binds it
    here. Review 2 saw a node without ``ip`` call it a tree talking to itself (NotRestorableHere) and start
    the job over."""
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    image_dir = _dumped(tmp_path, f"import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                  f"s.connect(('127.0.0.1', {peer.getsockname()[1]}))\nprint('ready', flush=True)\n"
                                  "time.sleep(60)")
    peer.close()
    [client] = inet_image.read_inet_sockets(image_dir)
    elsewhere = int.from_bytes(socket.inet_aton("192.0.2.7"), "little")  # TEST-NET-1: the node that is gone
    inet_image._rewrite(image_dir, {client.index: {11: elsewhere}})
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "ip" else real_which(name, *a, **k))
    assert prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.1) == []
    [after] = inet_image.read_inet_sockets(image_dir)
    assert after.src == ("0.0.0.0", 0) and after.dst == client.dst, after


def test_a_relay_that_serves_a_port_and_sends_to_it_elsewhere_keeps_its_destination(tmp_path):
    """A statsd, DNS or syslog relay: a UDP server on every address at port P, and a client connected to the
    same port P of a service elsewhere. The client's peer is not the tree's own server: review 3 saw its
    destination "moved" to this node, its datagrams going to itself, even on the node it ran on."""
    port = _free_port()
    image_dir = _dumped(tmp_path, f"import socket, time\nsrv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                  f"srv.bind(('0.0.0.0', {port}))\nc = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                  f"c.connect(('127.0.0.1', {port}))\nprint('ready', flush=True)\ntime.sleep(60)")
    [client] = [s for s in inet_image.read_inet_sockets(image_dir) if s.dst[1] == port]
    elsewhere = int.from_bytes(socket.inet_aton("192.0.2.9"), "little")  # TEST-NET-1: the service's host
    inet_image._rewrite(image_dir, {client.index: {12: elsewhere}})
    prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.1)
    [after] = [s for s in inet_image.read_inet_sockets(image_dir) if s.index == client.index]
    assert after.dst == ("192.0.2.9", port), after


def test_a_udp_port_the_tree_shared_by_choice_binds_beside_its_sharer_again(tmp_path):
    """A multicast receiver beside avahi, two statsd listeners: both set SO_REUSEADDR and share the port. The
    tree's socket did, so it binds beside the other again, as it did in its first life; review 3 saw it
    refused (NodeInTheWay) on the very node it ran on."""
    port = _free_port()
    sharer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sharer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sharer.bind(("127.0.0.1", port))
    try:
        image_dir = _dumped(tmp_path, f"import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                      "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                                      f"s.bind(('127.0.0.1', {port}))\nprint('ready', flush=True)\ntime.sleep(60)")
        [s] = inet_image.read_inet_sockets(image_dir)
        assert s.reuseaddr
        prepare_sockets(image_dir, "checkpoint t seq=1", wait=0.1)
    finally:
        sharer.close()

"""Before CRIU restores a checkpoint's sockets on this node: carry what can be carried, close what
cannot, and name what on the node stands in the way (issue 47; the image side is engine/inet_image.py).

- Connections with both ends in the tree are restored whole; their own leftovers on this node (the
  tree's previous life here: TIME_WAIT, or a close a dead dump's lock held up) are cleared first, and
  so is a dead dump's lock (engine/criu.py sweeps before each restore). Where they, or listeners, used
  the address of the node the checkpoint was taken on (not loopback), and this node lacks it, they move to this
  node's address for it (``ip route get``): a tree that talks to itself over its hostname's address
  (torchrun in a pod) restores on another node too. Its memory may still hold the old address (a
  store's host name resolved once): a new connection to it fails, and the job's own retry decides.
- Connections to peers outside the tree are restored closed: ENOTCONN on read, EPIPE on write, so the
  library reconnects (docs/compatibility.md lists which do by themselves).
- Connected UDP sockets that cannot bind their old address here are restored unbound (connect binds them
  to this node's address); one whose peer is a UDP server of the tree on the node's address moves with
  that address, destination included.
- Listening and bound UDP sockets must bind again here: each is probed as CRIU will bind it
  (TCP with ``SO_REUSEADDR``: a TIME_WAIT leftover does not block it; UDP only where the tree's socket
  set it, so that a UDP service sharing its port is not missed), but without ``SO_REUSEPORT``, so that a
  live listener of another process blocks it even where it shares ports. A port held by a live
  process is waited for a few seconds (a tree whose supervisor died here is killed by its watchdog
  within one), then raises :class:`NodeInTheWay` naming the holder.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..engine.fds import command_of, net_rows
from ..engine.inet_image import (InetSk, clear_leftovers, close_outside_connections, in_tree, move_addresses,
                                 read_inet_sockets, unbind_datagrams)
from ..errors import NodeInTheWay, NotRestorableHere

__all__ = ["PORT_WAIT_SECONDS", "holder_of", "prepare_sockets", "to_job"]

log = logging.getLogger(__name__)

#: How long a port held here is waited for: the watchdog of a tree whose supervisor died polls once a second.
PORT_WAIT_SECONDS = 5.0

_WILDCARDS = ("0.0.0.0", "::")


def _probe(s: InetSk) -> int:
    """0 when ``s`` can be bound here, else the errno. As CRIU binds it (``IPV6_V6ONLY`` as the image says;
    for TCP ``SO_REUSEADDR``, so a TIME_WAIT leftover does not count) but without ``SO_REUSEPORT``, which
    CRIU sets on every socket it restores: with it, a live listener of another process that set it too
    (nginx ``reuseport``, uvicorn ``--reuse-port``) would pass, and share its port with the restored tree.
    A UDP socket is probed without ``SO_REUSEADDR`` unless it had set it: a UDP service that set it (DNS,
    syslog, statsd daemons do) would pass, and the restored tree would take its datagrams."""
    family = socket.AF_INET6 if s.family == socket.AF_INET6 else socket.AF_INET
    addr = s.src[0]
    if family == socket.AF_INET6 and "." in addr:
        addr = f"::ffff:{addr}"
    kind = socket.SOCK_STREAM if s.proto == socket.IPPROTO_TCP else socket.SOCK_DGRAM
    try:
        probe = socket.socket(family, kind)
    except OSError as e:  # a node booted without IPv6 (ipv6.disable=1): EAFNOSUPPORT
        return e.errno or errno.EAFNOSUPPORT
    with probe:
        # TCP: a TIME_WAIT leftover must not count. UDP has none, and two UDP sockets that both set it share a
        # port: only where the tree's own did (a multicast receiver beside avahi, by choice) may this one
        if kind == socket.SOCK_STREAM or s.reuseaddr:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(s.v6only))
        try:
            probe.bind((addr, s.src[1]))
            if kind == socket.SOCK_STREAM and s.state == 10:  # a listener conflicts with listeners only at listen()
                probe.listen(1)
        except OSError as e:
            return e.errno or errno.EINVAL
    return 0


def _here(addr: str) -> bool:
    """Whether this node has ``addr`` (a wildcard and loopback it always has)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        probe = socket.socket(family, socket.SOCK_DGRAM)
    except OSError:  # no IPv6 on this node: not its address
        return False
    with probe:
        try:
            probe.bind((addr, 0))
        except OSError as e:
            return e.errno != errno.EADDRNOTAVAIL
    return True


def _has_ipv6() -> bool:
    """Whether this node has IPv6 at all (a kernel booted with ``ipv6.disable=1`` refuses AF_INET6)."""
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()
    except OSError:
        return False
    return True


def _route_source(addr: str) -> str | None:
    """The address this node sends from to reach ``addr`` (``ip route get``): on a node in the same
    network, its own address there; in a pod, the pod's new IP."""
    ip = shutil.which("ip")
    if ip is None:
        return None
    r = subprocess.run([ip, "-j", "route", "get", addr], capture_output=True, text=True, timeout=10)
    try:
        return str(json.loads(r.stdout)[0]["prefsrc"])
    except (ValueError, LookupError, TypeError):
        return None


def _moves(sockets: list[InetSk], what: str) -> dict[str, str]:
    """The checkpoint node's own addresses among ``sockets`` that this node lacks, each to this node's
    address for it. A tree that talks to itself over its node's address (torchrun's store and gloo bind
    the address its hostname resolves to: a pod's IP) would otherwise never restore anywhere else."""
    out: dict[str, str] = {}
    for addr in sorted({s.src[0] for s in sockets} | {s.dst[0] for s in sockets if s.dst[1] != 0}):
        if addr in _WILDCARDS or ipaddress.ip_address(addr).is_loopback or _here(addr):
            continue
        to = _route_source(addr)
        if to is None:
            raise NotRestorableHere(f"{what} cannot be restored on this node: its tree talks to itself over "
                                    f"{addr}, the address of the node it ran on, and this node has no route to "
                                    "choose an address of its own in its place. Check the node's network")
        out[addr] = to
    return out


def _bound_server(s: InetSk) -> bool:
    """A listener, or a UDP socket bound to a port and not connected (a server's)."""
    return not s.connection and s.src[1] != 0 and not (s.proto == socket.IPPROTO_UDP and s.dst[1] != 0)


def _to_tree_datagrams(sockets: list[InetSk]) -> list[InetSk]:
    """The connected UDP sockets whose peer is a UDP server of the tree itself (a metrics sidecar reached
    over the node's address): their destination is the tree's own address, and moves with it. A server
    on every address (a wildcard) is the peer only where the destination is the node's own address: the
    sender's own (the kernel sends to a local address from it), or one the tree bound; a relay that serves
    a port and sends to the same port elsewhere (statsd, DNS, syslog) must keep its destination."""
    # (read_inet_sockets gives a dual-stack socket's IPv4 peer as IPv4: the addresses compare as they are)
    servers = {s.src for s in sockets if s.proto == socket.IPPROTO_UDP and _bound_server(s)}
    own = {s.src[0] for s in sockets} - set(_WILDCARDS)

    def to_tree(s: InetSk) -> bool:
        if s.dst in servers:
            return True
        return any((w, s.dst[1]) in servers for w in _WILDCARDS) and (s.dst[0] == s.src[0] or s.dst[0] in own)

    return [s for s in sockets if s.proto == socket.IPPROTO_UDP and s.dst[1] != 0 and s.src[1] != 0 and to_tree(s)]


def holder_of(s: InetSk) -> str:
    """Who holds ``s``'s port here: ``pid 123 (python3 serve.py)``, or what the kernel says of it."""
    proto = "TCP" if s.proto == socket.IPPROTO_TCP else "UDP"
    inodes = {r.inode for r in net_rows(os.getpid()) if r.proto == proto and r.local[1] == s.src[1]}
    if not inodes:
        return "no process found (a socket the kernel still holds)"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                        return f"pid {pid} ({command_of(int(pid))})"
    return "a process this one cannot see"


def _end(end: tuple[str, int]) -> tuple[str, int]:
    return str(ipaddress.ip_address(end[0])), end[1]


def to_job(sockets: list[InetSk], job_peers: frozenset[tuple[str, int]]) -> list[InetSk]:
    """The connections whose other end is one of another part's endpoints (run/job.py): its peer resumes too,
    from the same seq."""
    return [s for s in sockets if s.connection and _end(s.dst) in job_peers] if job_peers else []


def _split(sockets: list[InetSk], job_peers: frozenset[tuple[str, int]]) -> tuple[list[InetSk], list[InetSk]]:
    """The connections restored whole (both ends in the tree, or the other end in another part of the
    job) and those to peers outside."""
    inside, outside = in_tree(sockets)
    job = to_job(outside, job_peers)
    return inside + job, [s for s in outside if s not in job]


def prepare_sockets(image_dir: Path, what: str, *, wait: float = PORT_WAIT_SECONDS,
                    sleep: Callable[[float], None] = time.sleep,
                    job_peers: frozenset[tuple[str, int]] = frozenset()) -> list[InetSk]:
    """Make ``image_dir``'s sockets restorable here (see the module doc); the outside connections it
    closed. ``what``: the checkpoint, as the error names it. ``job_peers``: the other parts' endpoints, where
    the tree is one part of a job (run/job.py): connections to them are restored whole, from the addresses
    they had, which this node must have. Raises NodeInTheWay."""
    sockets = read_inet_sockets(image_dir)
    if not sockets:
        return []
    if (v6 := next((s for s in sockets if s.family == socket.AF_INET6), None)) and not _has_ipv6():
        raise NodeInTheWay(f"{what} cannot be restored on this node: its socket {v6.describe()} is IPv6, and this "
                           "node runs without IPv6 (booted with ipv6.disable=1). Let the retry run on a node with "
                           "IPv6; the checkpoint stays the latest")
    inside, _ = _split(sockets, job_peers)
    own = inside + [s for s in sockets if _bound_server(s)] + _to_tree_datagrams(sockets)
    if job_peers and (moves := {k: v for k, v in _moves(own, what).items() if k not in {a for a, _ in job_peers}}):
        # a peer keeps sending to the address it knew: only this node having it lets the connection go on
        raise NodeInTheWay(f"{what} cannot be restored on this node: it is one part of a job, and its connections to "
                           f"the other parts use {', '.join(moves)}, the address its part had, which this node does "
                           "not have. Give the node that resumes this part that address (the job's network "
                           "namespace, or a pod IP that moves with it); the checkpoint stays the latest")
    if not job_peers and (moves := _moves(own, what)):
        moved = move_addresses(image_dir, own, moves)
        log.info("restore moves the tree's address %s on this node (%d socket(s): its connections inside the "
                 "tree, its listeners and its UDP sockets)", ", ".join(f"{a} to {b}" for a, b in moves.items()), moved)
        sockets = read_inet_sockets(image_dir)
    inside, outside = _split(sockets, job_peers)
    datagrams = [s for s in sockets if s.proto == socket.IPPROTO_UDP and s.dst[1] != 0 and s.src[1] != 0]
    rebind = [s for s in datagrams if _probe(s) != 0]  # connected: connect() binds it here as it did there
    bound = [s for s in sockets if _bound_server(s)]
    deadline = time.monotonic() + wait
    for s in bound:
        while (err := _probe(s)) == errno.EADDRINUSE and time.monotonic() < deadline:
            sleep(0.2)
        if err == errno.EADDRNOTAVAIL:
            raise NodeInTheWay(f"{what} cannot be restored on this node: its socket {s.describe()} is bound to "
                               f"{s.src[0]}, an address this node does not have. Bind the workload to 0.0.0.0 (or "
                               "::) to move between nodes; the checkpoint stays the latest for a node that has it")
        if err == errno.EADDRINUSE:
            raise NodeInTheWay(f"{what} cannot be restored on this node: the port of its socket {s.describe()} is "
                               f"held here by {holder_of(s)}. Stop that process, or let the retry run on another "
                               "node; the checkpoint stays the latest")
    close_outside_connections(image_dir, outside)
    unbind_datagrams(image_dir, rebind)
    if outside:
        log.info("restore closes %d connection(s) to peers outside the tree (the process gets an error and "
                 "reconnects): %s", len(outside), "; ".join(s.describe() for s in outside[:5]))
    clear_leftovers(inside)
    return outside

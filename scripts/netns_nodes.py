"""Test nodes as they are in life: each in a network namespace of its own, with its own address, on one
bridge with the machine (the "network" between nodes, where services outside the workload live).

A checkpoint taken on node-a and restored on node-b then meets what another machine would give it: node-a's
address is not there, its loopback is another loopback, its TIME_WAIT leftovers stay behind on node-a. The
supervisor (``cedana-airflow run``) runs inside the node with ``ip netns exec``, and so do the workload it
starts and the CRIU it calls. Everything is removed on exit: namespaces, veths, the bridge.

    with NetNodes(2) as (a, b):
        proc = subprocess.Popen(a.cmd(["cedana-airflow", "run", ...]))
        ... a.address, b.address, a.gateway (the machine's side of the bridge)
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NetNode", "NetNodes"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _used_subnets() -> set[str]:
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    return {str(ipaddress.ip_interface(line.split()[3]).network) for line in out.splitlines() if len(line.split()) > 3}


@dataclass(frozen=True)
class NetNode:
    name: str  # node-a, node-b, ...
    ns: str  # the network namespace
    address: str  # this node's address on the bridge
    gateway: str  # the machine's address on the bridge: services outside the nodes listen there

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's network namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    @property
    def device(self) -> str:
        """The node's end of its veth (its address is on it)."""
        return f"cp{self.ns[2:]}"

    def kill_all(self) -> None:
        """SIGKILL everything that runs in the node."""
        for pid in subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def lose(self) -> None:
        """The node dies: everything in it is SIGKILLed and its address leaves the network."""
        self.kill_all()
        _ip("-n", self.ns, "addr", "del", f"{self.address}/24", "dev", self.device, check=False)

    def take_over(self, lost: NetNode) -> None:
        """This node takes ``lost``'s address too, as a job's network namespace or a pod IP moves with its part."""
        _ip("-n", self.ns, "addr", "add", f"{lost.address}/24", "dev", self.device)

    def pod(self, argv: Sequence[str], hostname: str, hosts: str) -> list[str]:
        """``argv`` run as in a pod on this node: its own hostname, which ``/etc/hosts`` resolves to this
        node's address (as Kubernetes writes a pod's), so what binds "my hostname" (torchrun's gloo)
        binds this node's address. ``hosts``: a file to write that ``/etc/hosts`` to."""
        Path(hosts).write_text(f"127.0.0.1 localhost\n::1 localhost\n{self.address} {hostname}\n")
        script = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return self.cmd(["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script, hostname,
                         hosts, *argv])


class NetNodes:
    """``n`` nodes (node-a, node-b, ...) on a bridge of their own, in a /24 no interface here uses yet."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.tag = secrets.token_hex(3)  # interface names: 15 characters at most
        self.bridge = f"cbr{self.tag}"
        self.nodes: list[NetNode] = []

    def __enter__(self) -> list[NetNode]:
        used = _used_subnets()
        for _ in range(200):
            net = ipaddress.ip_network(f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.0/24")
            if str(net) not in used:
                break
        else:
            raise RuntimeError("no free 10.x.y.0/24 for the test nodes")
        hosts = list(net.hosts())
        gateway = str(hosts[0])
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.n):
                ns, host_end, node_end = f"cn{self.tag}{i}", f"cv{self.tag}{i}", f"cp{self.tag}{i}"
                address = str(hosts[1 + i])
                _ip("netns", "add", ns)
                _ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
                _ip("link", "set", host_end, "master", self.bridge, "up")
                _ip("link", "set", node_end, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", node_end)
                _ip("-n", ns, "link", "set", node_end, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "route", "add", "default", "via", gateway)
                self.nodes.append(NetNode(f"node-{chr(ord('a') + i)}", ns, address, gateway))
        except BaseException:
            self.__exit__()
            raise
        return self.nodes

    def __exit__(self, *exc: object) -> None:
        for i in range(self.n):
            ns = f"cn{self.tag}{i}"
            # what still runs in the namespace (a supervisor a failed test left) would keep it alive
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", f"cv{self.tag}{i}", check=False)
        _ip("link", "del", self.bridge, check=False)

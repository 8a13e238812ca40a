"""What a tree holds open that CRIU cannot carry, found before the tree is frozen.

CRIU fails a dump on a file it has no dumper for (``Unknown shit 600 (anon_inode:[io_uring])``) and,
before 4.2 on Linux 6.16 and later, on every TCP or UDP socket (``Can't get 1:16 opt``: the kernel
refuses ``SO_PASSCRED`` on inet sockets, checkpoint-restore/criu#2718). Either fails every heartbeat
the same way, after the tree was frozen and CRIU's parasite injected into it. Read from /proc
first, the line names the process, the file and the remedy, and the tree is never stopped.

Read-only, no signals: looking never disturbs the workload.
"""

from __future__ import annotations

import ipaddress
import os
import platform
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["NetRow", "Uncarried", "carries_inet_sockets", "command_of", "inet_sockets", "net_rows", "open_links",
           "uncarried", "version_tuple"]

#: anon_inode kinds CRIU has a dumper for (criu/*.c, each ``is_anon_link_type``; 4.1 and 4.2 alike).
#: Any other stops a dump; only those below are refused here, by name: another (a driver's) may be
#: gone by the time CRIU looks (a CUDA checkpoint releases the device first), so CRIU has the last word.
CARRIED_ANON = frozenset({"[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[pidfd]", "[signalfd]",
                          "[timerfd]", "bpf-map"})

#: The anon inodes workloads are known to hold that CRIU cannot dump, and what to do about each.
REMEDIES = {
    "[io_uring]": "CRIU cannot checkpoint an io_uring; set io_uring = deny (the default: the workload is refused "
                  "one, and libuv, in PyTorch's TCPStore and Node.js, falls back to epoll; UV_USE_IO_URING=0 no longer "
                  "does since libuv 1.50)",
    "[perf_event]": "CRIU cannot checkpoint a perf event; stop profiling the workload while it is opted in",
    "[userfaultfd]": "CRIU cannot checkpoint a userfaultfd; a workload that uses one cannot be checkpointed",
}

#: Linux refuses SO_PASSCRED on inet sockets from 6.16 on; CRIU reads it from every socket before 4.2.
_PASSCRED_KERNEL = (6, 16)
_INET_CRIU = (4, 2)
_NET_TABLES = ("tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6")
_TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
               7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}


def version_tuple(text: str) -> tuple[int, int]:
    """``"4.2.1"`` or ``"6.18.44-fc-v1272"`` as ``(4, 2)``, ``(6, 18)``; ``(0, 0)`` when unreadable."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def carries_inet_sockets(criu_version: str, kernel: str | None = None) -> bool:
    """Whether this CRIU can dump a TCP or UDP socket on this kernel."""
    kernel = kernel if kernel is not None else platform.release()
    return version_tuple(criu_version) >= _INET_CRIU or version_tuple(kernel) < _PASSCRED_KERNEL


@dataclass(frozen=True)
class Uncarried:
    pid: int
    fd: int
    what: str  # "anon_inode:[io_uring]", "TCP 0.0.0.0:8000 LISTEN"
    command: str  # the process's command line, cut short
    remedy: str

    def line(self) -> str:
        return f"pid {self.pid} ({self.command}) holds {self.what} on fd {self.fd}: {self.remedy}"


def open_links(pid: int) -> Iterable[tuple[int, str]]:
    """(fd, what it links to) of each open file of ``pid`` (none once it is gone)."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for name in names:
        try:
            yield int(name), os.readlink(f"/proc/{pid}/fd/{name}")
        except (OSError, ValueError):
            continue  # closed meanwhile


def command_of(pid: int) -> str:
    """A process's command line as one line of at most 60 characters (\"?\" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return "?"
    text = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())  # one line, whatever it held
    return text if len(text) <= 60 else text[:57] + "..."


def _end(hex_addr: str) -> tuple[str, int]:
    """A /proc/net endpoint (``0100007F:1F90``) as (address, port)."""
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        addr = str(ipaddress.IPv4Address(raw[::-1]))  # one little-endian word
    else:  # four little-endian words
        addr = str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
    return addr, int(port, 16)


def _endpoint(hex_addr: str) -> str:
    addr, port = _end(hex_addr)
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


@dataclass(frozen=True)
class NetRow:
    """One socket of a /proc/PID/net table."""

    proto: str  # "TCP", "UDP", "UDPLITE", "RAW"
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int  # TCP's state number (10: LISTEN)
    inode: int
    text: str  # as a person reads it: "TCP 127.0.0.1:8000 LISTEN"


def net_rows(pid: int, tables: tuple[str, ...] = _NET_TABLES) -> Iterator[NetRow]:
    """The sockets of ``pid``'s network namespace, from its /proc/PID/net ``tables``."""
    for table in tables:
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        proto = re.sub(r"6$", "", table).upper()
        for row in rows:
            cols = row.split()
            if len(cols) < 10:
                continue
            state = int(cols[3], 16)
            text = f"{proto} {_endpoint(cols[1])}"
            if proto == "TCP":
                text += f" {_TCP_STATES.get(state, state)}" + (f" to {_endpoint(cols[2])}" if state != 10 else "")
            yield NetRow(proto, _end(cols[1]), _end(cols[2]), state, int(cols[9]), text)


def inet_sockets(pid: int) -> dict[int, str]:
    """Socket inode -> ``"TCP 127.0.0.1:8000 LISTEN"`` for the inet sockets of ``pid``'s network
    namespace (its /proc/PID/net tables)."""
    return {r.inode: r.text for r in net_rows(pid)}


def uncarried(pids: Iterable[int], criu_version: str, kernel: str | None = None) -> list[Uncarried]:
    """Every open file of the tree that this CRIU would fail the dump on, in pid and fd order."""
    sockets_fail = not carries_inet_sockets(criu_version, kernel)
    out: list[Uncarried] = []
    for pid in sorted(pids):
        inet: dict[int, str] | None = None
        for fd, link in sorted(open_links(pid)):
            if link.startswith("anon_inode:"):
                remedy = REMEDIES.get(link[len("anon_inode:"):])
                if remedy is not None:
                    out.append(Uncarried(pid, fd, link, command_of(pid), remedy))
            elif sockets_fail and link.startswith("socket:["):
                if inet is None:
                    inet = inet_sockets(pid)
                what = inet.get(int(link[8:-1]))
                if what is not None:
                    out.append(Uncarried(pid, fd, f"a socket ({what})", command_of(pid), (
                        f"CRIU {criu_version} cannot dump a TCP or UDP socket on Linux {kernel or platform.release()} "
                        "(the kernel refuses SO_PASSCRED on inet sockets from 6.16 on: checkpoint-restore/criu#2718); "
                        "install CRIU 4.2 or later (scripts/install-criu.sh) or set CEDANA_CRIU to one")))
    return out

"""A checkpoint's TCP and UDP sockets, and what a restore on this node does with each (issue 47).

CRIU (with ``--tcp-established``, 4.2 on Linux 6.16+) carries a tree's sockets, but restores every one
exactly: the same addresses, ports and connection state. What that means depends on the other end:

- **A connection with both ends in the tree** (a torchrun job's store and gloo connections, a worker
  and its sidecar) is restored whole, both ends, and the job goes on without noticing. Its address
  pair may still be in use here, left by the tree's own previous life on this node (a restore on the
  same node after a crash): in TIME_WAIT, or in FIN_WAIT/LAST_ACK/CLOSING where a dead dump's lock
  dropped the close's packets. The kernel then refuses to connect it again ("Can't connect inet
  socket back: Cannot assign requested address"): those leftovers, sockets no process holds, are
  destroyed first (:func:`clear_leftovers`, sock_diag's SOCK_DESTROY, as ``ss -K`` does). They are
  the same connection's past; nothing else is touched.
- **A connection to a peer outside the tree** (an HTTP keep-alive pool, a database client) cannot be
  resumed: on another node its local address is not there, and on this one the peer saw it reset
  when the tree died. Its image entry is rewritten (:func:`close_outside_connections`) so that CRIU
  makes a socket that is closed and never connected: a read fails with ENOTCONN, a write with EPIPE,
  never a hang nor an EOF that would pass a cut stream for a whole one, and a library that reconnects does.
- **A connected UDP socket** (a metrics client) that cannot bind its old address here is rewritten
  unbound (:func:`unbind_datagrams`): ``connect`` then binds it as it did the first time.
- **A listening socket or a bound UDP socket** is bound again; an address this node does not have,
  or a port a live process here holds, stands in the way (run/sockets.py says which).

Field numbers from CRIU's images/fdinfo.proto (``file_entry``) and sk-inet.proto (``inet_sk_entry``),
the same in 4.1 and 4.2. The rewrite keeps every other byte of the image as it was.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .images import _payload_start, fields, message_values

__all__ = ["InetSk", "close_outside_connections", "clear_leftovers", "in_tree", "move_addresses", "read_inet_sockets",
           "unbind_datagrams"]

_FE_TYPE, _FE_ISK, _FD_INETSK = 1, 4, 4
# inet_sk_entry
_ISK_ID, _ISK_INO, _ISK_FAMILY, _ISK_TYPE, _ISK_PROTO, _ISK_STATE = 1, 2, 3, 4, 5, 6
_ISK_SRC_PORT, _ISK_DST_PORT, _ISK_SRC_ADDR, _ISK_DST_ADDR, _ISK_V6ONLY = 7, 8, 11, 12, 15
_ISK_SHUTDOWN = 19  # sk-inet.proto: which halves the kernel had shut (a peer's FIN shuts the read half)
_ISK_OPTS, _OPTS_REUSEADDR = 14, 7  # sk_opts_entry (sk-opts.proto)
_TCP_CLOSE = 7
_ANY: dict[int, str] = {socket.AF_INET: "0.0.0.0", socket.AF_INET6: "::"}
_TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
               7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}


@dataclass(frozen=True)
class InetSk:
    """One TCP or UDP socket of ``files.img`` (``index``: its entry there)."""

    index: int
    ino: int
    family: int
    proto: int
    state: int
    src: tuple[str, int]
    dst: tuple[str, int]
    v6only: bool = False  # IPV6_V6ONLY: an IPv6 socket that leaves IPv4 to others
    reuseaddr: bool = False  # SO_REUSEADDR: a UDP socket that set it shares its port with others that did

    @property
    def connection(self) -> bool:
        """What CRIU restores as a connection (sk-inet.c, ``tcp_connection``): TCP with a peer port."""
        return self.proto == socket.IPPROTO_TCP and self.dst[1] != 0

    def describe(self) -> str:
        proto = "TCP" if self.proto == socket.IPPROTO_TCP else "UDP" if self.proto == socket.IPPROTO_UDP else str(self.proto)
        what = f"{proto} {_show(self.src)}"
        if self.proto == socket.IPPROTO_TCP:
            what += f" {_TCP_STATES.get(self.state, self.state)}"
        return what + (f" to {_show(self.dst)}" if self.dst[1] else "")


def _show(end: tuple[str, int]) -> str:
    return f"[{end[0]}]:{end[1]}" if ":" in end[0] else f"{end[0]}:{end[1]}"


def _addr(words: list[int], family: int) -> str:
    raw = b"".join(struct.pack("<I", w) for w in words)  # the kernel's bytes, as CRIU copied them
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    a = ipaddress.IPv6Address(raw[:16])
    return str(a.ipv4_mapped) if a.ipv4_mapped is not None else str(a)  # a v4 peer of a dual-stack socket


def _entries(path: Path) -> tuple[bytes, list[tuple[int, int, bytes]]]:
    """The image's bytes and each entry as (offset of its length, its length, its message)."""
    buf = path.read_bytes()
    off, out = _payload_start(buf), []
    while off + 4 <= len(buf):
        (n,) = struct.unpack_from("<I", buf, off)
        if off + 4 + n > len(buf):
            raise ValueError(f"{path} is truncated")
        out.append((off, n, buf[off + 4 : off + 4 + n]))
        off += 4 + n
    return buf, out


def _ints(f: dict[int, list[int | bytes]], num: int) -> list[int]:
    return [v for v in f.get(num, []) if isinstance(v, int)]


def read_inet_sockets(image_dir: Path) -> list[InetSk]:
    """Every TCP and UDP socket of the image set (none without a files.img); ValueError when malformed."""
    path = image_dir / "files.img"
    if not path.exists():
        return []
    out = []
    try:
        for index, (_, _, msg) in enumerate(_entries(path)[1]):
            fe = message_values(msg)
            isk = fe.get(_FE_ISK)
            if _ints(fe, _FE_TYPE)[-1:] != [_FD_INETSK] or not isk or not isinstance(isk[-1], bytes):
                continue
            f = message_values(isk[-1])
            family, proto = _ints(f, _ISK_FAMILY)[-1], _ints(f, _ISK_PROTO)[-1]
            if proto not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                continue
            opts = [o for o in f.get(_ISK_OPTS, []) if isinstance(o, bytes)]
            reuseaddr = bool(opts) and _ints(message_values(opts[-1]), _OPTS_REUSEADDR)[-1:] == [1]
            out.append(InetSk(index, _ints(f, _ISK_INO)[-1], family, proto, _ints(f, _ISK_STATE)[-1],
                              (_addr(_ints(f, _ISK_SRC_ADDR), family), _ints(f, _ISK_SRC_PORT)[-1]),
                              (_addr(_ints(f, _ISK_DST_ADDR), family), _ints(f, _ISK_DST_PORT)[-1]),
                              bool(_ints(f, _ISK_V6ONLY)[-1:] == [1]), reuseaddr))
    except (IndexError, struct.error, ValueError) as e:
        raise ValueError(f"{path} is malformed ({e})") from None
    return out


def in_tree(sockets: Iterable[InetSk]) -> tuple[list[InetSk], list[InetSk]]:
    """The connections whose other end is in the image too, and those whose peer is outside."""
    conns = [s for s in sockets if s.connection]
    ends = {(s.src, s.dst) for s in conns}
    inside = [s for s in conns if (s.dst, s.src) in ends]
    return inside, [s for s in conns if (s.dst, s.src) not in ends]


def _encode_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _varint_field(num: int, value: int) -> bytes:
    return _encode_varint(num << 3) + _encode_varint(value)


def _replaced(msg: bytes, num: int, encoded: bytes) -> bytes:
    """``msg`` with every field ``num`` taken out and ``encoded`` (whole fields, keys included) written
    where the first one was, or at the end where there was none; every other field kept byte for byte."""
    out, written = bytearray(), False
    for fnum, _, _, start, end in fields(msg):
        if fnum != num:
            out += msg[start:end]
        elif not written:
            out += encoded
            written = True
    return bytes(out if written else out + encoded)


def _set_varints(msg: bytes, values: dict[int, int]) -> bytes:
    """``msg`` with the given varint fields set (replaced where present, appended where not)."""
    for num, v in values.items():
        msg = _replaced(msg, num, _varint_field(num, v))
    return msg


def _set_repeated(msg: bytes, num: int, values: list[int]) -> bytes:
    """``msg`` with every value of repeated varint field ``num`` replaced by ``values``."""
    return _replaced(msg, num, b"".join(_varint_field(num, v) for v in values))


def _words(addr: str, family: int, count: int) -> list[int]:
    """An address as CRIU stores it: the kernel's bytes in little-endian 32-bit words (``count`` of them:
    1 for IPv4, 4 for IPv6, where an IPv4 address is v4-mapped)."""
    a = ipaddress.ip_address(addr)
    if family == socket.AF_INET6 and isinstance(a, ipaddress.IPv4Address):
        a = ipaddress.IPv6Address(f"::ffff:{a}")
    raw = a.packed.ljust(4 * count, b"\0")
    return [struct.unpack_from("<I", raw, 4 * i)[0] for i in range(count)]


def move_addresses(image_dir: Path, sockets: Iterable[InetSk], moves: dict[str, str]) -> int:
    """Give ``sockets`` (connections with both ends in the tree, and listening or bound ones) this node's
    addresses in place of the checkpoint node's: ``moves`` maps one to the other. A connection keeps its
    ports and sequence numbers (TCP repair does not care which addresses carry them), and both of its ends
    move together. How many sockets changed."""
    changes: dict[int, dict[int, int | list[int] | None]] = {}
    for s in sockets:
        count = 1 if s.family == socket.AF_INET else 4
        change: dict[int, int | list[int] | None] = {}
        if s.src[0] in moves:
            change[_ISK_SRC_ADDR] = _words(moves[s.src[0]], s.family, count)
        if s.dst[1] != 0 and s.dst[0] in moves:  # a connection, or a connected UDP socket, in the tree
            change[_ISK_DST_ADDR] = _words(moves[s.dst[0]], s.family, count)
        if change:
            changes[s.index] = change
    _rewrite(image_dir, changes)
    return len(changes)


def _set_message(msg: bytes, num: int, value: bytes) -> bytes:
    """``msg`` with length-delimited field ``num`` set to ``value`` (CRIU writes it once)."""
    return _replaced(msg, num, _encode_varint(num << 3 | 2) + _encode_varint(len(value)) + value)


def close_outside_connections(image_dir: Path, which: Iterable[InetSk]) -> None:
    """Rewrite ``which`` (connections of ``image_dir``'s files.img) as sockets CRIU restores closed and
    never connected: state CLOSE, no ports, no shutdown. A read then fails with ENOTCONN and a write with
    EPIPE, and poll says POLLHUP: an error, never an EOF, which a reader of a stream would take for its
    end (data the socket held unread is lost with the connection, and must not look complete). The
    shutdown goes too: CRIU records one for every connection whose peer had sent its FIN (CLOSE_WAIT: a
    server that sent its answer and closed) and shuts the restored socket's read half with it, which
    reads as that EOF."""
    _rewrite(image_dir, {s.index: {_ISK_STATE: _TCP_CLOSE, _ISK_SRC_PORT: 0, _ISK_DST_PORT: 0, _ISK_SHUTDOWN: None}
                         for s in which})


def unbind_datagrams(image_dir: Path, which: Iterable[InetSk]) -> None:
    """Rewrite ``which`` (connected UDP sockets) without their local address and port: CRIU then does not
    bind them, and ``connect`` picks this node's address and a free port, as the first connect did."""
    _rewrite(image_dir, {s.index: {_ISK_SRC_PORT: 0, _ISK_SRC_ADDR: _words(_ANY[s.family], s.family,
                                                                           1 if s.family == socket.AF_INET else 4)}
                         for s in which})


def _rewrite(image_dir: Path, changes: dict[int, dict[int, int | list[int] | None]]) -> None:
    """Set varint fields of the inet_sk_entry of files.img entries (by index): an int sets a field, a
    list replaces every value of a repeated one (an address), None removes it. Every other byte is kept;
    atomic (a new file renamed over the old)."""
    if not changes:
        return
    path = image_dir / "files.img"
    buf, entries = _entries(path)
    out = bytearray(buf[: _payload_start(buf)])
    for index, (_, _, msg) in enumerate(entries):
        if index in changes:
            isk = message_values(msg)[_FE_ISK][-1]
            assert isinstance(isk, bytes)
            single = {k: v for k, v in changes[index].items() if isinstance(v, int)}
            for num, values in changes[index].items():
                if isinstance(values, list):
                    isk = _set_repeated(isk, num, values)
                elif values is None:
                    isk = _replaced(isk, num, b"")
            msg = _set_message(msg, _FE_ISK, _set_varints(isk, single))
        out += struct.pack("<I", len(msg)) + msg
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(out)
    os.replace(tmp, path)


#: The states a connection is left in once no process holds it: closing, or closed and waiting.
_LEFTOVER_STATES = [arg for state in ("time-wait", "fin-wait-1", "fin-wait-2", "last-ack", "closing")
                    for arg in ("state", state)]


def clear_leftovers(connections: Iterable[InetSk]) -> int:
    """Destroy this node's closing and closed sockets (TIME_WAIT, FIN_WAIT, LAST_ACK, CLOSING) that no
    process holds, with the address pair of one of ``connections`` (either direction): the tree's own
    past here, which would refuse the connection's restore (TIME_WAIT, where the kernel lets no connect
    reuse the pair: TCP timestamps off; the others always). A half-closed socket a live process still
    holds is left alone: its pair is in use, and the restore says so. One listing, then one ``ss -K``
    for all it found (one per leftover where that fails); ``ss`` from iproute2, nothing without it. How
    many are gone."""
    ss = shutil.which("ss")
    wanted = {(s.src, s.dst) for s in connections}
    if ss is None or not wanted:
        return 0
    found = _leftovers(ss, wanted)
    for i in range(0, len(found), 64):  # one ss per 64 leftovers: a torchrun job leaves one per connection
        chunk = found[i:i + 64]
        expr = " or ".join(f"( src {local} and dst {peer} )" for local, peer in chunk)
        if subprocess.run([ss, "-K", "-tn", *_LEFTOVER_STATES, expr], capture_output=True, timeout=10).returncode:
            for local, peer in chunk:  # one ss cannot parse spoils only itself
                subprocess.run([ss, "-K", "-tn", *_LEFTOVER_STATES, "src", local, "dst", peer], capture_output=True,
                               timeout=10)
    return len(found) - len(_leftovers(ss, wanted)) if found else 0


def _leftovers(ss: str, wanted: set[tuple[tuple[str, int], tuple[str, int]]]) -> list[tuple[str, str]]:
    """The leftovers of ``wanted``'s pairs here that no process holds (inode 0), as ``ss`` can filter them."""
    listing = subprocess.run([ss, "-Hetan", *_LEFTOVER_STATES], capture_output=True, text=True, timeout=10).stdout
    found = []
    for row in listing.splitlines():
        cols = row.split()
        ends = [c for c in cols if ":" in c and not c.startswith(("ino:", "sk:", "cgroup:", "uid:", "timer:"))]
        if len(ends) < 2 or "ino:0" not in cols:  # a live process's half-closed socket: not ours to destroy
            continue
        local, peer = _parse_end(ends[0]), _parse_end(ends[1])
        if (local, peer) in wanted or (peer, local) in wanted:
            found.append((_filterable(ends[0]), _filterable(ends[1])))
    return found


def _filterable(end: str) -> str:
    """``ss``'s printed end as its filter takes it: without the ``%dev`` of a socket bound to a device or
    of an IPv6 link-local address, which its parser refuses (the address and port name it already)."""
    host, _, port = end.rpartition(":")
    return f"{host.split('%')[0]}:{port}"


def _parse_end(text: str) -> tuple[str, int]:
    """``ss``'s ``10.0.0.5:41709`` or ``[::ffff:10.0.0.5]:41709`` as an InetSk end (v4-mapped as v4)."""
    host, _, port = text.rpartition(":")
    host = host.split("%")[0].strip("[]")  # "127.0.0.1%lo", "[fe80::1]%eth0": the device is not the address
    try:
        a = ipaddress.ip_address(host)
    except ValueError:
        return host, int(port) if port.isdigit() else 0
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return str(a), int(port)

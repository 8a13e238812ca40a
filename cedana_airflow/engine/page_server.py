"""The page-server side of CRIU's lazy-pages protocol, answering from any page source.

``criu lazy-pages --page-server --ps-socket FD`` asks for the pages a restored process faults on
(and, in the background, all the others) with requests ``u32 cmd, nr_pages, u64 vaddr, u64 dst_id``
in host byte order: ``nr_pages`` is a u32 up to CRIU 4.1 (24 bytes) and a u64 from 4.2 on (4 bytes
of padding after ``cmd``, 32 bytes; CRIU commit 7e0da4d9), so the layout follows the version. Each PS_IOV_GET
is answered, in order, by the same header (cmd PS_IOV_ADD_F with PE_PRESENT, nr_pages possibly
fewer) and then the pages. PS_IOV_CLOSE / PS_IOV_FORCE_CLOSE end the session; the daemon waits
for a 32-bit status.

We speak it over one end of a socketpair, never a TCP port: pages are process memory, and a port,
even on loopback, would hand them to any local user who connects first.

When the source fails (a chunk is corrupt, the store is gone), the server does not answer and does
not close: it calls ``on_failure`` and keeps the daemon waiting, so a process blocked on a page
fault stays blocked until its supervisor has killed it. Closing first would let the kernel hand it
zero-filled pages instead of its memory.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from .iov import IOV_MAX, advance
from .pagemap import PAGE_SIZE

__all__ = ["PageServer", "PageSource", "wire_for"]

_IOV_41 = struct.Struct("=IIQQ")  # CRIU <= 4.1
_IOV_42 = struct.Struct("=I4xQQQ")  # CRIU >= 4.2


def wire_for(criu_version: str) -> struct.Struct:
    """The request layout of this CRIU version's page-server protocol."""
    parts = [int(p) for p in criu_version.split(".")[:2] if p.isdigit()]
    return _IOV_42 if tuple(parts + [0, 0])[:2] >= (4, 2) else _IOV_41
PS_IOV_ADD_F, PS_IOV_GET = 6, 7
PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 0x1023, 0x1024
_CMD_BITS = 16
_PE_PRESENT = 4

#: (pid in the image, vaddr, nr_pages) -> the pages, as many as one run holds (at least one page),
#: in pieces (sent as they are, without joining them).
PageSource = Callable[[int, int, int], Sequence[bytes | memoryview]]


class PageServer(threading.Thread):
    """Serves one lazy-pages daemon on ``sock`` until it closes the session (:attr:`closed_cleanly`)
    or the source fails (:attr:`error`, after ``on_failure`` ran)."""

    def __init__(self, sock: socket.socket, source: PageSource, on_failure: Callable[[BaseException], None], *,
                 wire: struct.Struct) -> None:
        super().__init__(name="cedana-page-server", daemon=True)
        self.sock, self.source, self.on_failure, self.wire = sock, source, on_failure, wire
        self.error: BaseException | None = None
        self.closed_cleanly = False
        self.served_bytes = 0
        self.requests = 0
        self.busy_seconds = 0.0  # from a request read to its answer sent
        self._release = threading.Event()

    def release(self) -> None:
        """Let a failed server close its socket (the process it fed is dead by now)."""
        self._release.set()

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a source failure or a protocol error: the same fence
            self.error = e
            try:
                self.on_failure(e)
            finally:
                self._release.wait()
        finally:
            self.sock.close()

    def _recv_header(self) -> tuple[int, int, int, int] | None:
        buf = bytearray()
        while len(buf) < self.wire.size:
            part = self.sock.recv(self.wire.size - len(buf))
            if not part:
                if buf:
                    raise ConnectionError("the lazy-pages daemon sent half a request")
                return None
            buf += part
        cmd, nr, vaddr, dst = self.wire.unpack(buf)
        return cmd, nr, vaddr, dst

    def _serve(self) -> None:
        while (req := self._recv_header()) is not None:
            cmd, nr, vaddr, dst = req
            if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                self.sock.sendall(struct.pack("=i", 0))
                self.closed_cleanly = True
                return
            if cmd & ((1 << _CMD_BITS) - 1) != PS_IOV_GET:
                raise ConnectionError(f"the lazy-pages daemon sent a request we do not serve (cmd {cmd:#x})")
            t0 = time.perf_counter()
            pieces = self.source(dst, vaddr, nr)  # a GET names the process by its bare PID, not type-encoded
            size = sum(len(p) for p in pieces)
            n = size // PAGE_SIZE
            if n < 1 or n > nr or size % PAGE_SIZE:
                raise ValueError(f"the page source gave {size} bytes for {nr} pages at {vaddr:#x}")
            self._send([self.wire.pack((_PE_PRESENT << _CMD_BITS) | PS_IOV_ADD_F, n, vaddr, dst), *pieces])
            self.served_bytes += size
            self.requests += 1
            self.busy_seconds += time.perf_counter() - t0

    def _send(self, pieces: list[bytes | memoryview]) -> None:
        """One sendmsg for header and pages where the socket takes it all (it mostly does)."""
        left = [memoryview(p).cast("B") for p in pieces]
        while left:
            advance(left, self.sock.sendmsg(left[:IOV_MAX]))  # more buffers than that is EMSGSIZE

"""Random-access reads of one stored file, straight from its chunks: what a lazy restore feeds on.

Each chunk is fetched once and verified (digest and length) before any byte of it is returned;
a chunk that fails is never served, and every later read that needs it fails the same way. Reads
wait only for the chunks they touch. A prefetcher fetches ahead in the order it is given, keeping
at most ``window_bytes`` of fetched-but-unread data in memory; a chunk is dropped once each of its
bytes has been consumed, and fetched again if a read comes back for it. A byte is consumed once
however often it is read: by default when it is read, or, for a reader that may read a range again
before it can use it (our lazy-pages daemon, when the kernel says "not now"), when it says so
(:meth:`ChunkView.consume`).
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from ..format.manifest import FileEntry
from .base import Store
from .quarantine import read_chunk

__all__ = ["ChunkView"]


class ChunkView:
    """``pool`` fetches what reads wait for; ``prefetch_pool`` (default: the same) what is fetched
    ahead. With a pool of their own, reads never queue behind prefetches: the prefetcher keeps at
    most one fetch per worker of its pool in flight."""

    def __init__(self, store: Store, entry: FileEntry, pool: ThreadPoolExecutor, *, window_bytes: int,
                 prefetch_pool: ThreadPoolExecutor | None = None, prefetch_width: int = 4, reader: str = "") -> None:
        self.store, self.entry, self.pool, self.reader = store, entry, pool, reader  # reader: our node (quarantine)
        self.prefetch_pool, self.prefetch_width = prefetch_pool or pool, prefetch_width
        self._inflight = 0  # prefetches submitted and not done
        self.window_bytes = window_bytes
        self.starts: list[int] = []
        off = 0
        for c in entry.chunks:
            self.starts.append(off)
            off += c.size
        self.fetched_bytes = 0  # raw bytes fetched and verified, refetches included
        self._cond = threading.Condition()
        self._held: dict[int, Future[bytes | memoryview]] = {}
        self._unread: dict[int, int] = {}  # chunk -> its bytes not yet consumed
        self._seen: dict[int, list[list[int]]] = {}  # chunk -> the [lo, hi) of it consumed, sorted and merged
        self._held_bytes = 0
        self._closed = False

    def chunks_of(self, offset: int, length: int) -> range:
        if length <= 0:
            return range(0)
        first = bisect.bisect_right(self.starts, offset) - 1
        last = bisect.bisect_right(self.starts, offset + length - 1) - 1
        return range(first, last + 1)

    def _fetch(self, i: int) -> bytes | memoryview:
        ref = self.entry.chunks[i]
        raw = read_chunk(self.store, ref.digest, ref.size, self.reader)
        with self._cond:
            self.fetched_bytes += ref.size
        return raw

    def _hold(self, i: int, pool: ThreadPoolExecutor | None = None) -> Future[bytes | memoryview]:
        """The chunk's fetch, started now unless it is held already. Caller holds the lock."""
        fut = self._held.get(i)
        if fut is None:
            fut = (pool or self.pool).submit(self._fetch, i)
            self._held[i] = fut
            self._unread[i] = self.entry.chunks[i].size
            self._held_bytes += self.entry.chunks[i].size
        return fut

    def read(self, offset: int, length: int, *, consume: bool = True) -> list[bytes | memoryview]:
        """``length`` bytes from ``offset`` as pieces (views into the chunks: no copy), every chunk
        they come from verified. Raises what the fetch raised: CorruptCheckpoint, StoreUnavailable.
        ``consume=False``: the bytes stay held until :meth:`consume` says they are used."""
        if offset < 0 or length < 0 or offset + length > self.entry.size:
            raise ValueError(f"{self.entry.name}: read of {length} bytes at {offset} is outside its {self.entry.size}")
        idxs = self.chunks_of(offset, length)
        with self._cond:
            futs = [(i, self._hold(i)) for i in idxs]
        out: list[bytes | memoryview] = []
        for i, fut in futs:
            raw = memoryview(fut.result())
            lo = max(offset - self.starts[i], 0)
            hi = min(offset + length - self.starts[i], len(raw))
            out.append(raw[lo:hi])
            if consume:
                self._consumed(i, lo, hi)
        return out

    def consume(self, offset: int, length: int) -> None:
        """These bytes are used: a chunk whose every byte is goes (read with ``consume=False``)."""
        for i in self.chunks_of(offset, length):
            start = self.starts[i]
            self._consumed(i, max(offset - start, 0), min(offset + length - start, self.entry.chunks[i].size))

    def _consumed(self, i: int, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of chunk ``i`` are used; counted once however often they are read."""
        with self._cond:
            if i not in self._unread or hi <= lo:
                return
            seen = self._seen.setdefault(i, [])
            new = hi - lo
            k = bisect.bisect_left(seen, [lo, lo])
            if k > 0 and seen[k - 1][1] >= lo:  # merge with the interval before
                k -= 1
            j = k
            while j < len(seen) and seen[j][0] <= hi:  # and every one it touches after
                s, e = seen[j]
                new -= max(0, min(e, hi) - max(s, lo))
                lo, hi = min(lo, s), max(hi, e)
                j += 1
            seen[k:j] = [[lo, hi]]
            self._unread[i] -= new
            if self._unread[i] <= 0:
                del self._unread[i], self._held[i], self._seen[i]
                self._held_bytes -= self.entry.chunks[i].size
                self._cond.notify_all()

    def prefetch(self, order: Iterable[int], then: Callable[[int], None] | None = None) -> None:
        """Fetch these chunks ahead of the reads, in this order, within the window (background);
        ``then(i)`` runs on the fetching thread once chunk ``i`` is in and verified (it may read)."""
        def fetched(i: int, fut: Future[bytes | memoryview]) -> None:
            if then is not None and not fut.cancelled() and fut.exception() is None:
                then(i)

        def run() -> None:
            for i in order:
                with self._cond:
                    while not self._closed and i not in self._held and (
                            self._held_bytes >= self.window_bytes or self._inflight >= self.prefetch_width):
                        self._cond.wait(0.5)
                    if self._closed:
                        return
                    if i in self._held:
                        continue
                    self._inflight += 1
                    fut = self._hold(i, self.prefetch_pool)
                # its slot stays taken until `then` is done: the window bounds the work, not just the fetch
                fut.add_done_callback(functools.partial(fetched, i))
                fut.add_done_callback(self._prefetched)
        threading.Thread(target=run, name="cedana-prefetch", daemon=True).start()

    def _prefetched(self, _: Future[bytes | memoryview]) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop prefetching and drop what is held."""
        with self._cond:
            self._closed = True
            for fut in self._held.values():
                fut.cancel()
            self._held.clear()
            self._unread.clear()
            self._seen.clear()
            self._held_bytes = 0
            self._cond.notify_all()

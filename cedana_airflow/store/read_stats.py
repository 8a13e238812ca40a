"""How many chunks this process read from its store, and the seconds they took: for a restore's timeline.

One set of counters per process (a supervisor restores one checkpoint at a time); a timeline takes
snapshots and reports differences. Seconds are summed over the threads that read, so they can
exceed the wall time of a parallel fetch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["READS", "ReadCounts", "ReadStats"]


@dataclass(frozen=True)
class ReadCounts:
    chunks: int = 0
    bytes: int = 0  # raw (decoded) bytes
    get_seconds: float = 0.0  # waiting for the store
    verify_seconds: float = 0.0  # decompressing and checking the digest

    def __sub__(self, other: ReadCounts) -> ReadCounts:
        return ReadCounts(self.chunks - other.chunks, self.bytes - other.bytes,
                          self.get_seconds - other.get_seconds, self.verify_seconds - other.verify_seconds)

    def as_dict(self) -> dict[str, float | int]:
        return {"chunks": self.chunks, "bytes": self.bytes, "get_seconds": round(self.get_seconds, 4),
                "verify_seconds": round(self.verify_seconds, 4)}


class ReadStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = ReadCounts()

    def add(self, nbytes: int, get_seconds: float, verify_seconds: float) -> None:
        with self._lock:
            c = self._counts
            self._counts = ReadCounts(c.chunks + 1, c.bytes + nbytes, c.get_seconds + get_seconds,
                                      c.verify_seconds + verify_seconds)

    def snapshot(self) -> ReadCounts:
        with self._lock:
            return self._counts


READS = ReadStats()
